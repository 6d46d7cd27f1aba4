"""Offline steps on a latency-relaxed instance under `tidal`: fewer, whole steps.

OOCO §3.2.1: a latency-relaxed instance's step time "is not restricted", yet every step pays the
fixed per-step cost (launches, scheduling: the roofline's O_p, OOCO §3.3), so an offline step
capped at tens of milliseconds spends a share of the instance on it that a longer step does not
(`TidalConfig.relaxed_step_s`, 0.1 s; `ooco`'s `offline_step_cap_s` was 0.05, 0.4 s since). OOCO
§3.4.1 lets an arriving online prefill cut an offline step at a layer boundary so that its TTFT
is what pure P/D serving gives. The engines and the simulator keep a cut step's finished layers
and resume the chunk, paying one more step's fixed part (`tidal.sim.resume`). A step that ends
within a small share of the TTFT SLO anyway delays the online prefill by no more than that
("acceptable compared to the seconds-level TTFT SLO", §3.4.1's own measure for a layer's wait),
so `tidal` can leave such a step uncut (`TidalConfig.relaxed_uncut_ttft`, off by default). An
online prefill step with room left under the same bound takes offline prefill chunks too
(`TidalConfig.relaxed_fill`, HyGen §4.1's hybrid batch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tidal.policy.base import StepPlan
from tidal.policy.plan_builder import PlanBuilder, plan_shape
from tidal.policy.state import InstanceState, Phase, ReqState


def keep_uncut(
    inst: InstanceState, plan: StepPlan, ttft_slo_s: float, uncut_ttft: float
) -> StepPlan:
    """`plan` without its layer cut when its step lasts at most `uncut_ttft` x the TTFT SLO:
    an online prefill arriving during it waits for its end instead of cutting it."""
    if not plan.layer_cut or uncut_ttft <= 0.0:
        return plan
    if inst.step_model.step_s(plan_shape(inst, plan)) > uncut_ttft * ttft_slo_s:
        return plan
    return dataclasses.replace(plan, layer_cut=False)


def fill_online_step(
    inst: InstanceState, plan: StepPlan, online: Sequence[ReqState], bound_s: float
) -> StepPlan:
    """HyGen's hybrid batch (§4.1, Alg. 1) on a relaxed instance: an online prefill step that
    takes every online prompt waiting there whole is topped up with offline prefill chunks
    while it stays within `bound_s`, so the offline tokens do not pay a step overhead of their
    own. A step that leaves online prompt tokens waiting is not filled (OOCO §3.4.1: offline
    work never delays online prefill behind it)."""
    if plan.decode or not plan.prefill:
        return plan
    if any(plan.prefill.get(r.req_id, 0) < r.num_prefill_left for r in online):
        return plan
    b = PlanBuilder(inst)
    for r in online:
        b.add_prefill(r, cap=plan.prefill[r.req_id])
    if b.prefill != dict(plan.prefill) or b.step_s() >= bound_s:
        return plan
    offline = [r for r in inst.running if not r.is_online and r.num_prefill_left > 0]
    offline += [r for r in inst.waiting if not r.is_online]
    for r in offline:
        if r.phase not in (Phase.RUNNING, Phase.WAITING):
            continue
        if b.add_prefill(r, bound_s=bound_s) == 0:
            break
    return dataclasses.replace(plan, prefill=b.prefill)
