"""A prefill/decode pair of real SGLang servers under one Tidal instance (SGLang's PD
disaggregation carries the prefill -> decode push). Needs a GPU: SGLang's KV transfer backends
(`TIDAL_SGLANG_PD_TRANSFER`, default mooncake_tcp) move device memory; never run in CI.
tests/e2e/sglang_stack.py says which variables steer it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from services.instance.sglang.launcher import SglangProcess, free_port
from tests.e2e.metrics_kit import metric
from tests.e2e.sglang_stack import (
    SglangStack,
    extra_server_args,
    model_and_python,
    tidal_over,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.e2e,
    pytest.mark.nats,
    pytest.mark.slow,
]

PD_TRANSFER = os.environ.get("TIDAL_SGLANG_PD_TRANSFER", "mooncake_tcp")  # no RDMA needed


@pytest.fixture(scope="module")
def pd_stack() -> Iterator[SglangStack]:
    """One `aggregated` instance over a prefill and a decode server sharing the GPU."""
    model, python = model_and_python()
    common = ["--mem-fraction-static", "0.3", "--disaggregation-transfer-backend", PD_TRANSFER]
    common += extra_server_args()
    boot = str(free_port())
    prefill_args = [*common, "--disaggregation-mode", "prefill"]
    prefill_args += ["--disaggregation-bootstrap-port", boot]
    prefill = SglangProcess(python, model, "127.0.0.1", free_port(), prefill_args)
    decode = SglangProcess(
        python, model, "127.0.0.1", free_port(), [*common, "--disaggregation-mode", "decode"]
    )
    up = ["--policy", "aggregated", "--instances", "aggregated"]
    up += ["--sglang-urls", prefill.url, "--sglang-decode-urls", decode.url]
    with tidal_over([prefill, decode], model, up) as st:
        yield st


def test_a_pd_pair_serves_the_openai_client_and_counts_its_kv_pushes(
    pd_stack: SglangStack,
) -> None:
    before = metric(pd_stack.base, "tidal_migrations_total", mode="pd_transfer", outcome="ok")
    got = pd_stack.client().completions.create(
        model=pd_stack.model,
        prompt="The capital of France is",
        max_tokens=48,
        temperature=0,
        extra_body={"request_class": "online", "ignore_eos": True},
    )
    assert got.usage is not None and got.usage.completion_tokens == 48
    assert "Paris" in got.choices[0].text
    deadline = time.monotonic() + 30  # heartbeats carry the count to the gateway
    while (
        metric(pd_stack.base, "tidal_migrations_total", mode="pd_transfer", outcome="ok") <= before
    ):
        assert time.monotonic() < deadline, "no prefill -> decode push was counted"
        time.sleep(0.2)
