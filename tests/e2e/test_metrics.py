"""The gateway's /metrics as Prometheus reads it (`prometheus_client.parser`), after real requests
through `tidal up --engine sim`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from services.cli import natsd
from tests.e2e.conftest import Stack, start_stack, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.nats]
MODEL = "tidal-sim"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with start_stack() as st:
        yield st


def samples(stack: Stack) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] from the gateway's /metrics."""
    base = stack.base_url.removesuffix("/v1")
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def slo_count(stack: Stack, attained: str) -> float:
    rows = samples(stack).get("tidal_slo_requests_total", [])
    return sum(v for labels, v in rows if labels["attained"] == attained)


def chat(stack: Stack, **extra: object) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
    )
    assert resp.choices[0].finish_reason == "length"


def test_a_request_without_slo_headers_is_held_to_the_default_slo(stack: Stack) -> None:
    # A default TPOT target of 1 µs that no request meets: a request naming no SLO of its own
    # is held to it and counted as missed (it used to count as attained, whatever its latency).
    before = {a: slo_count(stack, a) for a in ("true", "false", "no_slo")}
    default = json.loads(stack.ctl("req", "tidal.ctl.policy").stdout)["slo"]
    ctl = stack.ctl("req", "tidal.ctl.policy.set", json.dumps({"tpot_slo_s": 1e-6}))
    assert ctl.returncode == 0 and "error" not in json.loads(ctl.stdout), ctl.stdout
    try:
        chat(stack)
        assert slo_count(stack, "false") == before["false"] + 1
        assert slo_count(stack, "true") == before["true"]
        # Its own (generous) targets win over the default.
        chat(stack, extra_headers={"X-Tidal-TTFT-Ms": "60000", "X-Tidal-TPOT-Ms": "60000"})
        assert slo_count(stack, "true") == before["true"] + 1
        assert slo_count(stack, "no_slo") == before["no_slo"]
    finally:
        stack.ctl("req", "tidal.ctl.policy.set", json.dumps({"tpot_slo_s": default["tpot_s"]}))


VLLM_PER_REQUEST = {  # family -> its sample names (a histogram's _bucket, _sum, _count)
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
}
VLLM_PER_INSTANCE = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def families(stack: Stack) -> dict[str, Metric]:
    base = stack.base_url.removesuffix("/v1")
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_metrics_after_a_streamed_request(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    fams = families(stack)
    for name, kind in VLLM_PER_REQUEST.items():
        fam = fams[name]
        assert fam.type == kind, name
        assert {s.labels.get("model_name") for s in fam.samples} == {MODEL}, name
    gen = fams["vllm:generation_tokens"].samples
    assert sum(s.value for s in gen if s.name == "vllm:generation_tokens_total") >= 6
    itl = fams["vllm:inter_token_latency_seconds"].samples
    # one sample per token after the first (5 here), not one per request
    assert sum(s.value for s in itl if s.name.endswith("_count")) >= 5
    e2e = fams["vllm:e2e_request_latency_seconds"].samples
    assert (
        max(float(s.labels["le"]) for s in e2e if "le" in s.labels and s.labels["le"] != "+Inf")
        >= 600
    )
    ok = fams["vllm:request_success"].samples
    assert any(s.labels["finished_reason"] == "length" and s.value >= 1 for s in ok)
    # The instance's gauges: one series per instance of the model, labelled as vLLM's.
    status = stack.status()
    for name in VLLM_PER_INSTANCE:
        fam = fams[name]
        assert fam.type == "gauge"
        engines = {s.labels["engine"] for s in fam.samples}
        assert {s.labels["model_name"] for s in fam.samples} == {MODEL}
        assert engines and all(e in json.dumps(status) for e in engines), (name, engines)


def test_a_second_gateway_does_not_export_the_cluster_series_again(stack: Stack) -> None:
    state = json.loads(Path(stack.env["TIDAL_STATE_FILE"]).read_text())
    port = natsd.free_port()
    argv = [sys.executable, "-m", "services.gateway", "--nats-url", state["nats_url"]]
    argv += ["--id", "gateway-extra", "--port", str(port)]
    proc = subprocess.Popen(argv, env=stack.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    second = Stack(proc, f"http://127.0.0.1:{port}/v1", stack.env, stack.log_path)
    try:
        # both have heard each other and the instances for a few beats
        wait_until(lambda: _up(second), 30, "the second gateway")
        time.sleep(2.0)
        cluster = [*VLLM_PER_INSTANCE, "tidal_queue_depth"]
        old, new = families(stack), families(second)
        for name in cluster:
            assert old[name].samples, name  # the longest-running gateway exports them
            assert name not in new or not new[name].samples, name  # the other does not
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def _up(st: Stack) -> bool:
    try:
        return bool(families(st))
    except OSError:
        return False
