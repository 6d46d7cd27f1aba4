"""The gateway's metrics (`services/gateway/metrics.py`) from hand-made inputs."""

from __future__ import annotations

from services.gateway.metrics import slo_attained


def test_a_request_without_an_slo_is_not_counted_as_attained() -> None:
    assert slo_attained(5.0, 1.0, None, None) == "no_slo"


def test_a_request_is_held_to_each_target_it_has() -> None:
    assert slo_attained(0.2, 0.01, 300.0, 20.0) == "true"
    assert slo_attained(0.4, 0.01, 300.0, 20.0) == "false"  # TTFT 400 ms > 300 ms
    assert slo_attained(0.2, 0.03, 300.0, 20.0) == "false"  # TPOT 30 ms > 20 ms
    assert slo_attained(0.2, 9.0, 300.0, None) == "true"  # no TPOT target: TTFT decides
