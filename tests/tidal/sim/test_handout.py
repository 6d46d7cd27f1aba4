"""A held request the tick dispatches to an idle instance starts there `handout_s` later (the
live hand-out: report, scheduler tick and reply, the Batch API service's submit, the instance's
next loop; `Simulator(handout_s=)`, `ClusterConfig.handout_ms`)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tidal.sim.test_core import make_policy_for, make_setup, req
from tidal.config.cluster import load_config
from tidal.policy import InstanceRole
from tidal.schemas.enums import RequestClass
from tidal.sim.build import simulate
from tidal.sim.core import Simulator

PD = (InstanceRole.PREFILL, InstanceRole.DECODE)
OFF, ON = RequestClass.OFFLINE, RequestClass.ONLINE


def _starts(handout_s: float, online_at: float | None = None) -> dict[str, float]:
    sim = Simulator(
        [make_setup(r) for r in PD],
        make_policy_for("online-priority", PD),
        handout_s=handout_s,
        check=True,
    )
    reqs = [req("a", 0.0, 100, 3, OFF), req("b", 0.0, 100, 3, OFF)]
    if online_at is not None:
        reqs.append(req("o", online_at, 100, 3, ON))
    rec = sim.run(sorted(reqs, key=lambda r: r.arrival_s))
    return {r.req_id: r.start_s for r in rec.requests if r.start_s is not None}


def test_each_hand_out_to_the_idle_prefill_instance_waits() -> None:
    # online-priority hands one held line at a time to the idle prefill instance. Prefill of
    # 100 tokens: 0.01 + 0.001 * 100 = 0.11 s. a: handed out at 0, starts 0.02, first token
    # 0.13; its push (100 * 1000 B at 25 GB/s) is in flight ~4 us, then b is handed out and
    # starts 0.02 later.
    s = _starts(0.02)
    assert s["a"] == pytest.approx(0.02)
    assert s["b"] == pytest.approx(0.13 + 0.02, abs=1e-4)
    # none: each starts at once
    s0 = _starts(0.0)
    assert s0["a"] == 0.0 and s0["b"] == pytest.approx(0.11, abs=1e-4)


def test_an_online_request_does_not_wait_for_a_hand_out() -> None:
    # o arrives at 0.01 while a's hand-out is on its way: routed, it starts at once (with a)
    s = _starts(0.02, online_at=0.01)
    assert s["o"] == pytest.approx(0.01) and s["a"] == pytest.approx(0.01)


def test_no_hand_out_is_the_old_simulator_and_a_config_keeps_every_request() -> None:
    cfg = dataclasses.replace(load_config("configs/ooco.yaml"), duration_s=5.0)
    base = simulate(cfg, "online-priority")
    zero = simulate(dataclasses.replace(cfg, handout_ms=0.0), "online-priority")
    assert [r.last_token_s for r in base.requests] == [r.last_token_s for r in zero.requests]
    rec = simulate(dataclasses.replace(cfg, handout_ms=10.0), "online-priority", check=True)
    assert len(rec.requests) == len(base.requests)
    assert all(r.finish_s is not None for r in rec.requests)
    # offline lines wait for their hand-outs: later first tokens, none earlier on average
    first = {r.req_id: r.first_token_s for r in base.requests if not r.is_online}
    late = [r.first_token_s - first[r.req_id] for r in rec.requests if not r.is_online]
    assert sum(late) > 0


def test_a_negative_hand_out_is_refused() -> None:
    with pytest.raises(ValueError, match="handout_ms"):
        dataclasses.replace(load_config("configs/ooco.yaml"), handout_ms=-1.0)
    with pytest.raises(ValueError, match="handout_s"):
        Simulator([make_setup(r) for r in PD], make_policy_for("online-priority", PD), handout_s=-1)
