"""Real-sized traffic on the live path: long prompts whose KV is a 7B model's size.

`tidal up` with the sim engine emulating Qwen2.5-7B on an A100 (57,344 KV bytes per token, so a
32k-token request carries 1.9 GB of KV) and the OOCO policy: online requests prefill on the
relaxed instance and are pushed to the strict one to decode; offline work is pulled back. Eight
concurrent streamed chats of 4k-32k tokens and four offline requests, through the official
openai client. Every request must finish with its full token count, no instance may be declared
dead, every service's event loop must stay responsive, and the instances' memory must not grow
with the KV they move (it streams through bounded chunks)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import Stack, start_stack
from tests.e2e.metrics_kit import metric

pytestmark = [pytest.mark.e2e, pytest.mark.nats]

KV_BYTES_PER_TOKEN = 57_344
MAX_TOKENS = 24
ONLINE = [4096 * (i + 1) for i in range(8)]  # 4k ... 32k tokens
OFFLINE = [2048, 3072, 1024, 4096]
LAG_MAX_S = 0.25  # the bound on any service's loop lag


def prompt_of(num_tokens: int, seed: int) -> str:
    # " tide" and friends are one token each in SmolLM2's tokenizer (the sim engine's default)
    words = [" tide", " moon", " sea", " salt", " wave", " shore", " foam", " reef"]
    return "".join(words[(seed + i) % len(words)] for i in range(num_tokens - 16))


def chat(stack: Stack, num_tokens: int, seed: int, req_class: str) -> tuple[int, str]:
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", timeout=240, max_retries=0)
    stream = client.chat.completions.create(
        model="tidal-sim",
        messages=[{"role": "user", "content": prompt_of(num_tokens, seed)}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "request_class": req_class, "slo_ttft_ms": 30_000},
    )
    finish, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return usage.completion_tokens, finish


def peak_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert m is not None
    return int(m.group(1)) * 1024


def test_long_prompts_at_7b_kv_size_all_complete_with_migrations() -> None:
    args = ("--sim-step-model", "qwen2.5-7b@a100-80gb", "--config", "configs/ooco.yaml")
    args += ("--policy", "ooco", "--max-model-len", "40000", "--cpu-attn", "0")
    with start_stack(*args) as stack:
        base = stack.base_url.removesuffix("/v1")
        jobs = [(n, i, "online") for i, n in enumerate(ONLINE)]
        jobs += [(n, 100 + i, "offline") for i, n in enumerate(OFFLINE)]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda j: chat(stack, *j), jobs))
        assert results == [(MAX_TOKENS, "length")] * len(jobs)
        pushes = metric(base, "tidal_migrations_total", kind="push", outcome="ok")
        pulls = metric(base, "tidal_migrations_total", kind="pull", outcome="ok")
        moved = metric(base, "tidal_kv_transfer_bytes_total")
        assert pushes >= 4, f"only {pushes} push migrations"
        assert moved >= 4 * 4096 * KV_BYTES_PER_TOKEN  # at least four requests' KV moved
        status = stack.status()
        log = stack.log()
        assert "went silent" not in log and "did not answer probes" not in log, log[-4000:]
        lags = {
            f"{s['kind']}/{s['id']}": json.loads(s["info"]["loop_lag"])["max_s"]
            for s in status.get("services", [])
            if "loop_lag" in s.get("info", {})
        }
        assert {k.split("/")[0] for k in lags} >= {"gateway", "scheduler", "instance"}, lags
        assert max(lags.values()) < LAG_MAX_S, lags
        biggest_kv = max(ONLINE) * KV_BYTES_PER_TOKEN
        instances = [s["pid"] for s in status["services"] if s["kind"] == "instance"]
        assert len(instances) == 2
        for pid in instances:
            # the instances moved several GB of KV; none ever held a request's worth of it
            assert peak_rss_bytes(pid) < biggest_kv / 2, (pid, peak_rss_bytes(pid))
        print(
            f"\npushes {pushes:.0f}, pulls {pulls:.0f}, KV moved {moved / 1e9:.1f} GB, "
            f"loop lag max per service {lags}"
        )
