"""The gateway's /metrics as Prometheus reads it (`prometheus_client.parser`), after real requests
through `tidal up --engine sim`."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Stack, start_stack

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
