"""Tidal on a real SGLang: openai client -> gateway -> `--engine sglang` instances -> SGLang.

Marked `sglang`: never part of `make test`. `make test-sglang` runs it on this CPU (SGLang 0.5.23
from PyPI in a scratch venv, its torch-native CPU paths: scripts/sglang_cpu_env.sh); on a GPU
host, `TIDAL_SGLANG_PYTHON=... pytest -m sglang tests/e2e`. Two SGLang servers, one per
instance (relaxed + strict, policy `tidal`); tests/e2e/sglang_stack.py says which variables
steer it.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator

import pytest

from services.instance.sglang.launcher import SglangProcess, free_port
from tests.e2e.metrics_kit import metric
from tests.e2e.sglang_stack import (
    SglangStack,
    extra_server_args,
    model_and_python,
    sglang_alone,
    tidal_over,
)
from tidal.engine.tokenizer import load_tokenizer

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.nats, pytest.mark.slow]

MAX_RUNNING = 4  # SGLang's running slots per server: offline work fills them below
SERVER_ARGS = ["--max-running-requests", str(MAX_RUNNING)]


@pytest.fixture(scope="module")
def stack() -> Iterator[SglangStack]:
    model, python = model_and_python()
    args = ["--mem-fraction-static", "0.35", *SERVER_ARGS, *extra_server_args()]
    servers = [SglangProcess(python, model, "127.0.0.1", free_port(), args) for _ in "rs"]
    urls = ",".join(s.url for s in servers)
    with tidal_over(servers, model, ["--sglang-urls", urls]) as st:
        yield st


def test_the_openai_client_streams_from_real_sglang(stack: SglangStack) -> None:
    chunks = list(
        stack.client().chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].system_fingerprint == "tidal-sglang"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_recompute_migration_keeps_the_output(stack: SglangStack) -> None:
    """The `tidal` policy pushes an online request from the relaxed to the strict instance; on
    SGLang that is abort + resubmit with the generated ids, and greedy output is unchanged."""
    before = metric(stack.base, "tidal_migrations_total", outcome="ok", mode="recompute")
    prompt = "Write a long story about a lighthouse keeper."
    got = stack.client().completions.create(
        model=stack.model,
        prompt=prompt,
        max_tokens=96,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.usage is not None and got.usage.completion_tokens == 96
    tok = load_tokenizer(stack.model)
    alone = sglang_alone(stack.sglang_urls[0], tok.encode(prompt), 96)
    assert got.choices[0].text == tok.decode(alone)
    deadline = time.monotonic() + 30
    while metric(stack.base, "tidal_migrations_total", outcome="ok", mode="recompute") <= before:
        assert time.monotonic() < deadline, "no recompute migration was counted"
        time.sleep(0.2)


def test_online_work_overtakes_offline_work_by_sglang_priority(stack: SglangStack) -> None:
    """Offline requests fill both servers' running slots with as many again queued; an online
    request arriving behind them goes in at a higher SGLang priority and ends long before the
    queued offline ones, which all end with every token they asked for (preempted ones
    recompute, nothing is lost)."""
    client = stack.client()
    n_offline = 4 * MAX_RUNNING
    before = metric(stack.base, "tidal_sglang_retractions_total")

    def ask(cls: str, n: int) -> tuple[str, float, int]:
        r = client.completions.create(
            model=stack.model,
            prompt="Count slowly from one to one thousand.",
            max_tokens=n,
            temperature=0,
            extra_body={"request_class": cls, "ignore_eos": True},
        )
        assert r.usage is not None
        return cls, time.monotonic(), r.usage.completion_tokens

    with cf.ThreadPoolExecutor(n_offline + 8) as pool:
        offline = [pool.submit(ask, "offline", 128) for _ in range(n_offline)]
        time.sleep(3)
        online = pool.submit(ask, "online", 16)
        _, online_done, online_n = online.result(timeout=600)
        still_running = sum(1 for f in offline if not f.done())
        results = [f.result(timeout=1800) for f in offline]
    assert online_n == 16
    assert still_running >= n_offline // 2, "the online request waited behind the offline work"
    assert all(n == 128 for _, _, n in results)
    # the later half, queued in Tidal or SGLang when the online request came, ends after it
    assert all(done > online_done for _, done, _ in results[n_offline // 2 :])
    # SGLang's own scheduler made the room: it retracted a running offline request (heartbeats
    # carry the count to the gateway)
    deadline = time.monotonic() + 30
    while metric(stack.base, "tidal_sglang_retractions_total") <= before:
        assert time.monotonic() < deadline, "SGLang retracted no offline request"
        time.sleep(0.5)
