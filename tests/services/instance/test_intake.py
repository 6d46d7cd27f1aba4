"""`intake.to_engine_request`: a wire request as the engine takes it, and the client's errors as
ValueErrors (the worker answers them as `invalid_request` / `context_length_exceeded`)."""

from __future__ import annotations

import argparse

import pytest

from services.instance.engines import build_engine
from services.instance.intake import to_engine_request
from tidal.engine.api import ControllableEngine, RequestClass
from tidal.schemas.messages import GenerateRequest, SamplingSpec

MAX_LEN = 256


@pytest.fixture(scope="module")
def engine() -> ControllableEngine:
    args = argparse.Namespace(engine="sim", model="", max_model_len=MAX_LEN, kv_cache_tokens=4096,
                              tokenizer="bytes", sim_step_model="zero")  # fmt: skip
    return build_engine(args)


def req(prompt: str, max_tokens: int, **kw: object) -> GenerateRequest:
    sampling = SamplingSpec(max_tokens=max_tokens, max_tokens_is_default=bool(kw.pop("d", False)))
    return GenerateRequest("r", "m", sampling, "tidal.gw.x", prompt=prompt, **kw)  # type: ignore[arg-type]


def test_a_default_max_tokens_is_fitted_to_the_context_left(engine: ControllableEngine) -> None:
    out = to_engine_request(engine, req("hello", 10_000, d=True))
    n = len(out.prompt_token_ids)
    assert out.sampling.max_tokens == MAX_LEN - n and out.req_class is RequestClass.ONLINE


def test_resumed_tokens_become_input_and_count_against_max_tokens(
    engine: ControllableEngine,
) -> None:
    plain = to_engine_request(engine, req("hello", 8))
    out = to_engine_request(engine, req("hello", 8, resume_token_ids=[65, 66, 67]))
    assert out.prompt_token_ids == [*plain.prompt_token_ids, 65, 66, 67]
    assert out.sampling.max_tokens == 5


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (req("", 8), "empty"),
        (req("hello", 8, resume_token_ids=[65] * 8), "resume_token_ids"),
        (req("x" * 300, 8), "context"),
    ],
)
def test_client_errors_are_value_errors(
    engine: ControllableEngine, bad: GenerateRequest, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        to_engine_request(engine, bad)
