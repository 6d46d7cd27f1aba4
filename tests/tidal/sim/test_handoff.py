"""A push after prefill reaches its source `handoff_delay_s` after the step (the live scheduler's
report -> tick -> command) and leaves at the source's next step boundary from then
(`Simulator(handoff_delay_s=)`, `ClusterConfig.handoff_delay_ms`)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tidal.sim.test_core import make_policy_for, make_setup, req
from tidal.config.cluster import load_config
from tidal.policy import InstanceRole
from tidal.sim.build import simulate
from tidal.sim.core import Simulator

PD = (InstanceRole.PREFILL, InstanceRole.DECODE)


def _lands(handoff_delay_s: float) -> list[float]:
    sim = Simulator(
        [make_setup(r) for r in PD],
        make_policy_for("pd-disagg", PD),
        link_bytes_per_s=1e6,
        link_latency_s=0.05,
        handoff_delay_s=handoff_delay_s,
        check=True,
    )
    rec = sim.run([req("a", 0.0, 100, 1000), req("b", 0.0, 100, 1000)])
    return [next(r.queued_s for r in rec.requests if r.req_id == x) for x in "ab"]


def test_push_waits_for_the_source_step_it_began_meanwhile() -> None:
    # Prefills of 100 tokens, one a step (0.01 + 0.001 * 100 = 0.11): a's first token at 0.11,
    # b's at 0.22. KV 100 tokens * 1000 B at 1e6 B/s = 0.1 s. a's push reaches P at
    # 0.11 + 0.02 = 0.13, inside b's prefill (0.11 -> 0.22): exported at 0.22, the rest of the
    # fixed part (0.05 - 0.02) -> a's bytes from 0.25. b's reaches an idle P at 0.24: exported
    # at once, its bytes from 0.27, when a has 0.08 s of bytes left: both at half rate, a lands
    # at 0.27 + 0.16 = 0.43, b (0.02 s left) alone -> 0.45.
    assert _lands(0.02) == [pytest.approx(0.43), pytest.approx(0.45)]


def test_no_handoff_delay_is_the_old_simulator() -> None:
    # a: 0.11 + 0.05 -> bytes 0.16 -> 0.26; b: 0.22 + 0.05 = 0.27 -> 0.37
    assert _lands(0.0) == [pytest.approx(0.26), pytest.approx(0.37)]
    cfg = dataclasses.replace(load_config("configs/ooco.yaml"), duration_s=5.0)
    base = simulate(cfg, "ooco")
    zero = simulate(dataclasses.replace(cfg, handoff_delay_ms=0.0), "ooco")
    assert [r.last_token_s for r in base.requests] == [r.last_token_s for r in zero.requests]


def test_handoff_delay_on_a_config_keeps_every_request() -> None:
    cfg = dataclasses.replace(
        load_config("configs/ooco.yaml"), duration_s=5.0, link_latency_ms=20.0
    )
    rec = simulate(dataclasses.replace(cfg, handoff_delay_ms=10.0), "ooco", check=True)
    base = simulate(cfg, "ooco")
    assert len(rec.requests) == len(base.requests)
    assert rec.num_kv_transfers == base.num_kv_transfers > 0
    assert all(r.finish_s is not None for r in rec.requests)


@pytest.mark.parametrize("delay_ms", [-1.0, 30.0])
def test_handoff_delay_outside_the_link_latency_is_refused(delay_ms: float) -> None:
    cfg = load_config("configs/ooco.yaml")
    with pytest.raises(ValueError, match="handoff_delay_ms"):
        dataclasses.replace(cfg, link_latency_ms=20.0, handoff_delay_ms=delay_ms)
    with pytest.raises(ValueError, match="handoff_delay_s"):
        Simulator(
            [make_setup(r) for r in PD],
            make_policy_for("pd-disagg", PD),
            link_latency_s=0.02,
            handoff_delay_s=delay_ms / 1000,
        )
