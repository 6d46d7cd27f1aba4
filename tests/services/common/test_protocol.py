from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    resolve_class_and_slo,
)
from tidal.config.classes import parse_classes

CHAT = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_sampling_mapping() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": CHAT,
            "temperature": 0,
            "stop": "\n",
            "seed": 7,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    s = req.sampling()
    assert s.max_tokens == DEFAULT_CHAT_MAX_TOKENS and s.max_tokens_is_default
    assert s.temperature == 0 and s.stop == ["\n"] and s.seed == 7 and s.logprobs == 2
    explicit = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CHAT, "max_completion_tokens": 9}
    ).sampling()
    assert explicit.max_tokens == 9 and not explicit.max_tokens_is_default


def test_text_parts_are_joined() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        }
    )
    assert req.chat_messages()[0].content == "ab"


@pytest.mark.parametrize(
    "bad",
    [
        {"messages": CHAT},
        {"model": "", "messages": CHAT},
        {"model": "m", "messages": CHAT, "top_p": 0},
        {"model": "m", "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]},
        {"model": "m", "messages": CHAT, "slo_ttft_ms": -1},
    ],
)
def test_invalid_chat_bodies_are_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(bad)


def test_completion_rules() -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["x"]}).prompt_text() == "x"
    assert (
        CompletionRequest.model_validate({"model": "m", "prompt": "x"}).sampling().max_tokens == 16
    )
    with pytest.raises(ValidationError, match="echo"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True})


def test_class_and_slo_from_body_or_headers() -> None:
    def named(spec_slos: tuple) -> tuple:  # type: ignore[type-arg]
        spec, ttft, tpot = spec_slos
        return spec.name, ttft, tpot

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT})
    assert named(resolve_class_and_slo(body, {})) == ("online", None, None)
    hdrs = {"x-tidal-class": "Offline", "x-tidal-ttft-ms": "250", "x-tidal-tpot-ms": "40"}
    assert named(resolve_class_and_slo(body, hdrs)) == ("offline", 250.0, 40.0)
    both = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CHAT, "request_class": "online", "slo_ttft_ms": 100}
    )
    assert named(resolve_class_and_slo(both, hdrs)) == ("online", 100.0, 40.0)  # the body wins
    for bad in ({"x-tidal-class": "gold"}, {"x-tidal-ttft-ms": "soon"}, {"x-tidal-tpot-ms": "0"}):
        with pytest.raises(ApiError) as err:
            resolve_class_and_slo(body, bad)
        assert err.value.status == 400
    with pytest.raises(ApiError, match="unknown request class 'gold'; classes: online, offline"):
        resolve_class_and_slo(body, {"x-tidal-class": "gold"})


def test_class_from_a_configured_table_and_key_rule() -> None:
    table = parse_classes(
        [
            {"name": "interactive", "priority": 2, "ttft_ms": 500},
            {"name": "standard", "priority": 1, "ttft_ms": 3000, "demote": True},
            {"name": "batch", "priority": 0, "best_effort": True},
        ],
        keys={"key-0123456789abcdef": {"cap": "standard"}},
    )
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT})
    spec, _, _ = resolve_class_and_slo(body, {"x-tidal-class": "standard"}, table)
    assert spec.name == "standard" and spec.ttft_ms == 3000
    spec, _, _ = resolve_class_and_slo(body, {}, table, "key-0123456789abcdef")
    assert spec.name == "standard"  # capped
    with pytest.raises(ApiError, match="or looser") as err:
        resolve_class_and_slo(body, {"x-tidal-class": "interactive"}, table, "key-0123456789abcdef")
    assert err.value.status == 400 and err.value.param == "request_class"
