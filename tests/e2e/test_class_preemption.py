"""A higher request class preempts a lower one on the live stack (`tidal up --engine sim`, one
aggregated instance with a small KV pool, the official openai client): three standard requests
fill the pool; an interactive request then evicts the latest of them (recomputed, never lost),
meets its TTFT target, and the gateway counts the eviction under `standard`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from tests.e2e.conftest import Stack, start_stack
from tests.e2e.metrics_kit import metric
from tidal.configs import config_path

pytestmark = [pytest.mark.e2e, pytest.mark.nats]

MODEL = "tidal-sim"
CLASSES = [
    {"name": "interactive", "priority": 2, "ttft_ms": 500, "tpot_ms": 200},
    {"name": "standard", "priority": 1, "ttft_ms": 8000, "tpot_ms": 500},
    {"name": "batch", "priority": 0, "best_effort": True},
]
KV_TOKENS = 1792  # 112 blocks of 16: the three standard requests (35 blocks each at most) fit
STD_OUT = 450  # standard: ~101 prompt + 450 output tokens
INT_PROMPT = "tide " * 500  # interactive: ~501 prompt tokens, 32 blocks with its first token
# Past ~327 output tokens each, the standard requests hold over 80 blocks: fewer than 32 free.
SEND_AT = 345


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = yaml.safe_load(config_path("classes.yaml").read_text())
    data |= {"classes": CLASSES, "default_class": "standard"}
    data["instances"] = [{"role": "aggregated", "chunk_size": 256}]
    path: Path = tmp_path_factory.mktemp("classes") / "small_kv.yaml"
    path.write_text(yaml.safe_dump(data))
    extra = (
        "--policy", "aggregated", "--kv-cache-tokens", str(KV_TOKENS),
        "--max-model-len", "1024", "--sim-step-model", "linear:0.01,0,0,0",
    )  # fmt: skip
    with start_stack("--config", str(path), "--cpu-attn", "0", *extra) as st:
        yield st


def test_interactive_evicts_standard_keeps_its_slo_and_nothing_is_lost(stack: Stack) -> None:
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    words = [0, 0, 0]
    texts = ["", "", ""]
    finish: list[str | None] = [None, None, None]
    lock = threading.Lock()

    def standard(k: int) -> None:
        stream = c.completions.create(
            model=MODEL, prompt="sea " * 100, max_tokens=STD_OUT, stream=True,
            extra_headers={"X-Tidal-Class": "standard"}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            for ch in chunk.choices:
                with lock:
                    texts[k] += ch.text
                    words[k] = len(texts[k].split())
                    finish[k] = ch.finish_reason or finish[k]

    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(standard, k) for k in range(3)]
        deadline = time.monotonic() + 30
        while min(words) < SEND_AT:
            assert time.monotonic() < deadline, words
            assert not any(f.done() for f in futs), [f.result() for f in futs if f.done()]
            time.sleep(0.005)
        raw = c.completions.with_raw_response.create(
            model=MODEL, prompt=INT_PROMPT, max_tokens=20,
            extra_headers={"X-Tidal-Class": "interactive"}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for f in futs:
            f.result(timeout=60)

    body = raw.parse()
    assert raw.headers["x-tidal-class"] == "interactive"
    assert body.model_extra["tidal"]["server_ttft_ms"] <= 500  # its class's TTFT target
    assert finish == ["length"] * 3  # every standard request completed, evicted one included
    assert all(len(t.split()) == STD_OUT for t in texts), [len(t.split()) for t in texts]
    # the instance reports the eviction; the gateway counts it under the class it ran in
    deadline = time.monotonic() + 5
    while metric(stack.base_url, "tidal_class_preemptions_total", req_class="standard") < 1:
        assert time.monotonic() < deadline, "no eviction of a standard request was counted"
        time.sleep(0.1)
    assert metric(stack.base_url, "tidal_class_preemptions_total", req_class="interactive") == 0
    assert metric(stack.base_url, "tidal_slo_requests_total", req_class="interactive",
                  attained="true") == 1  # fmt: skip
