"""OpenAI sampling fields through the real stack with the official client: each field Tidal
implements changes the answer as OpenAI's does; each it does not is a 400 naming it (`param`).

The sampling fields run on the torch engine with the embedded SmolLM2 (`tidal up --engine torch`,
one aggregated instance); `n`, `logprobs` and the refusals also on the sim engine's stack."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.cli import natsd
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.nats]
SIM = "tidal-sim"
REAL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Write a poem about the sea and the tide."}]
TIDE = 17662  # " tide" in SmolLM2's vocabulary


def sim_client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def torch_client() -> Iterator[openai.OpenAI]:
    """`tidal up` with the torch engine and the embedded model, one aggregated instance."""
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-e2e-fields-"))
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json")}
    env.pop("TIDAL_NATS_URL", None)
    tidal = str(Path(sys.executable).parent / "tidal")
    argv = [tidal, "up", "--port", str(port), "--instances", "aggregated", "--policy", "aggregated"]
    argv += ["--cpu-attn", "0", "--store-dir", str(tmp / "js"), "--log-level", "WARNING"]
    with open(tmp / "up.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with contextlib.suppress(openai.APIError):
                if [m.id for m in client.models.list()] == [REAL]:
                    break
            time.sleep(0.5)
        else:
            raise AssertionError((tmp / "up.log").read_text())
        yield client
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def greedy(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=REAL, messages=CHAT, max_tokens=24, temperature=0, **extra
    )


def most_repeated(resp: Any) -> int:
    """How often the answer's most frequent token occurs in it."""
    tokens = [t.token for t in resp.choices[0].logprobs.content]
    return max(Counter(tokens).values())


# ---- implemented: torch engine -------------------------------------------------------------
slow = pytest.mark.slow  # the real model on CPU


@slow
def test_logit_bias(torch_client: openai.OpenAI) -> None:
    resp = greedy(torch_client, logit_bias={str(TIDE): 100})
    assert resp.choices[0].message.content == " tide" * 24


@slow
def test_frequency_penalty(torch_client: openai.OpenAI) -> None:
    base = greedy(torch_client, logprobs=True)
    penalised = greedy(torch_client, logprobs=True, frequency_penalty=2.0)
    assert penalised.choices[0].message.content != base.choices[0].message.content
    assert most_repeated(penalised) < most_repeated(base)


@slow
def test_presence_penalty(torch_client: openai.OpenAI) -> None:
    base = greedy(torch_client, logprobs=True)
    penalised = greedy(torch_client, logprobs=True, presence_penalty=2.0)
    assert penalised.choices[0].message.content != base.choices[0].message.content
    assert most_repeated(penalised) < most_repeated(base)


@slow
def test_logprobs_and_top_logprobs(torch_client: openai.OpenAI) -> None:
    resp = greedy(torch_client, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token and abs(lps[0] - t.logprob) < 1e-4


@slow
def test_seed(torch_client: openai.OpenAI) -> None:
    def sampled(seed: int) -> str:
        resp = torch_client.chat.completions.create(
            model=REAL, messages=CHAT, max_tokens=16, temperature=1.0, seed=seed
        )
        return str(resp.choices[0].message.content)

    assert sampled(7) == sampled(7)
    assert len({sampled(s) for s in (1, 2, 3)}) > 1


@slow
def test_n(torch_client: openai.OpenAI) -> None:
    resp = torch_client.chat.completions.create(
        model=REAL, messages=CHAT, max_tokens=12, temperature=1.0, seed=11, n=3
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) > 1  # each choice sampled on its own (seeds 11, 12, 13)
    assert resp.usage is not None and resp.usage.completion_tokens == 36
    again = torch_client.chat.completions.create(
        model=REAL, messages=CHAT, max_tokens=12, temperature=1.0, seed=11, n=3
    )
    assert [c.message.content for c in again.choices] == texts


# ---- implemented: sim engine ---------------------------------------------------------------


def test_n_streamed_on_the_sim_engine(stack: Stack) -> None:
    stream = sim_client(stack).completions.create(
        model=SIM, prompt="The sea", max_tokens=5, n=2, stream=True
    )
    chunks = [c for c in stream if c.choices]
    by_index: dict[int, str] = {}
    for c in chunks:
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    assert sorted(by_index) == [0, 1]
    assert all(len(t.split()) == 5 for t in by_index.values())


def test_logprobs_on_the_sim_engine(stack: Stack) -> None:
    resp = sim_client(stack).completions.create(
        model=SIM, prompt="The sea", max_tokens=4, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == resp.choices[0].text
    assert len(lp.token_logprobs or []) == 4 and all(len(t) == 2 for t in lp.top_logprobs or [])


def test_streamed_offline_logprobs_cover_every_token_of_the_larger_chunks(stack: Stack) -> None:
    """An offline request's tokens come several to a chunk: each chunk's logprobs list them all."""
    stream = sim_client(stack).completions.create(
        model=SIM,
        prompt="The sea",
        max_tokens=80,
        logprobs=2,
        stream=True,
        extra_body={"request_class": "offline", "ignore_eos": True},
    )
    chunks = [c for c in stream if c.choices and c.choices[0].text]
    text = "".join(c.choices[0].text for c in chunks)
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    for c in chunks:
        lp = c.choices[0].logprobs
        assert lp is not None and len(lp.tokens or []) == len(lp.token_logprobs or [])
        tokens += lp.tokens or []
        offsets += lp.text_offset or []
        tops += lp.top_logprobs or []
    assert "".join(tokens) == text and len(tokens) == 80
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(80)]
    assert all(len(t) == 2 for t in tops)
    assert len(chunks) < 80  # several tokens a chunk


# ---- refused -------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("param", "extra"),
    [
        ("tools", {"tools": [TOOL]}),
        ("tool_choice", {"tool_choice": "auto"}),
        ("response_format", {"response_format": {"type": "json_object"}}),
        ("response_format", {"response_format": {"type": "json_schema", "json_schema": {}}}),
        ("functions", {"functions": [TOOL["function"]]}),
        ("function_call", {"function_call": "auto"}),
        ("store", {"store": True}),
        ("modalities", {"modalities": ["text", "audio"]}),
        ("reasoning_effort", {"reasoning_effort": "high"}),
        ("min_p", {"extra_body": {"min_p": 0.1}}),
    ],
)
def test_refused_field_is_a_400_naming_it(stack: Stack, param: str, extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        sim_client(stack).chat.completions.create(model=SIM, messages=CHAT, max_tokens=4, **extra)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert body["code"] == "unsupported_parameter" and param in body["message"]


def test_harmless_fields_are_accepted(stack: Stack) -> None:
    resp = sim_client(stack).chat.completions.create(
        model=SIM,
        messages=CHAT,
        max_tokens=3,
        user="u1",
        store=False,
        response_format={"type": "text"},
    )
    assert resp.choices[0].finish_reason == "length"
