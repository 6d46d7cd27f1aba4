"""Offline steps on a latency-relaxed instance under `tidal`: fewer, whole steps.

OOCO §3.2.1: a latency-relaxed instance's step time "is not restricted", yet every step pays the
fixed per-step cost (launches, scheduling: the roofline's O_p, OOCO §3.3), so an offline step
capped at tens of milliseconds spends a share of the instance on it that a longer step does not
(`TidalConfig.relaxed_step_s`). OOCO §3.4.1 lets an arriving online prefill cut an offline step
at a layer boundary so that its TTFT is what pure P/D serving gives; the cut step's work is
redone. A step that ends within a small share of the TTFT SLO anyway delays the online prefill
by no more than that ("acceptable compared to the seconds-level TTFT SLO", §3.4.1's own measure
for a layer's wait), so `tidal` leaves such a step uncut and keeps its work
(`TidalConfig.relaxed_uncut_ttft`).
"""

from __future__ import annotations

import dataclasses

from tidal.perf.api import BatchShape
from tidal.policy.base import StepPlan
from tidal.policy.batch_shape import add_decode, add_prefill
from tidal.policy.state import InstanceState


def plan_shape(inst: InstanceState, plan: StepPlan) -> BatchShape:
    """The batch `plan`'s first step runs on `inst` (its GPU prefill chunks and decodes)."""
    by_id = {r.req_id: r for r in inst.running}
    for r in inst.waiting:
        by_id.setdefault(r.req_id, r)
    shape = BatchShape()
    for rid, n in plan.prefill.items():
        r = by_id.get(rid)
        shape = add_prefill(shape, n, r.num_computed_tokens if r is not None else 0)
    ctx = sum(by_id[rid].num_computed_tokens for rid in plan.decode if rid in by_id)
    return add_decode(shape, len(plan.decode), ctx)


def keep_uncut(
    inst: InstanceState, plan: StepPlan, ttft_slo_s: float, uncut_ttft: float
) -> StepPlan:
    """`plan` without its layer cut when its step lasts at most `uncut_ttft` x the TTFT SLO:
    an online prefill arriving during it waits for its end instead of discarding it."""
    if not plan.layer_cut or uncut_ttft <= 0.0:
        return plan
    if inst.step_model.step_s(plan_shape(inst, plan)) > uncut_ttft * ttft_slo_s:
        return plan
    return dataclasses.replace(plan, layer_cut=False)
