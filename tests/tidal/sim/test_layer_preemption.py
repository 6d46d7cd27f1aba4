"""OOCO §3.4.1 layer-level preemption: an online arrival cuts a preemptible offline step."""

from __future__ import annotations

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import Policy, StepPlan
from tidal.policy.state import InstanceRole, InstanceState
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.workload.mix import SimRequest

LINEAR = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


class OnlineFirstPrefill(Policy):
    """Whole-prompt prefills, online first; offline steps are preemptible at 10 layers."""

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        todo = [r for r in inst.running if r.num_prefill_left > 0] + inst.waiting
        online = [r for r in todo if r.is_online]
        if online:
            return StepPlan(prefill={online[0].req_id: online[0].num_prefill_left})
        if todo:
            r = todo[0]
            return StepPlan(prefill={r.req_id: r.num_prefill_left}, layer_cut=True)
        return StepPlan()


def test_online_arrival_cuts_offline_step_at_next_layer() -> None:
    setup = InstanceSetup(InstanceRole.RELAXED, 4096, 200, LINEAR, 1.0, num_layers=10)
    sim = Simulator([setup], OnlineFirstPrefill(), check=True)
    rec = sim.run(
        [
            SimRequest("off", RequestClass.OFFLINE, 0.0, 990, 1),
            SimRequest("on", RequestClass.ONLINE, 0.25, 90, 1),
        ]
    )
    off, on = sorted(rec.requests, key=lambda r: r.req_id)
    # off's step would take 0.01 + 0.99 = 1.0 s (10 layers of 0.1 s); "on" arrives at 0.25,
    # the step stops at the 0.3 s layer boundary; on's prefill 0.01 + 0.09 = 0.1 s -> 0.4;
    # off starts over: 0.4 + 1.0 = 1.4.
    assert on.first_token_s == pytest.approx(0.4)
    assert off.first_token_s == pytest.approx(1.4)
    assert rec.num_layer_preemptions == 1
    busy = sum(sum(b) for b in rec.busy_s)
    assert busy == pytest.approx(0.3 + 0.1 + 1.0)


def test_offline_arrival_does_not_cut() -> None:
    setup = InstanceSetup(InstanceRole.RELAXED, 4096, 200, LINEAR, 1.0, num_layers=10)
    sim = Simulator([setup], OnlineFirstPrefill(), check=True)
    rec = sim.run(
        [
            SimRequest("a", RequestClass.OFFLINE, 0.0, 990, 1),
            SimRequest("b", RequestClass.OFFLINE, 0.25, 90, 1),
        ]
    )
    a, b = sorted(rec.requests, key=lambda r: r.req_id)
    assert a.first_token_s == pytest.approx(1.0)
    assert b.first_token_s == pytest.approx(1.1)
    assert rec.num_layer_preemptions == 0
