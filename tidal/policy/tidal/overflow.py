"""Tidal's CPU-attention overflow on latency-strict instances (OmniServe §3.3.1, §3.3.5-§3.3.6
inside OOCO's strict pool, with HyGen's budgeted offline prefill)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.policy.base import InstanceState, Phase, ReqState, StepPlan
from tidal.policy.omniserve.control import piggyback_admission
from tidal.policy.tidal_adapt import PlanBuilder

if TYPE_CHECKING:
    from tidal.policy.tidal.policy import TidalPolicy

_MIN_TOKENS_LEFT = 16  # not worth a KV copy to the host for a request about to finish


def pick_offloads(inst: InstanceState, gpu_offline: list[ReqState], bound_s: float) -> list[str]:
    """§3.3.5: offline decodes to move to the CPU-attention workers, longest context first, while
    one CPU step over everything offloaded stays within `bound_s`; at most one per step (its KV
    copy to the host lengthens the step) and within the host's KV memory."""
    cpu = inst.cpu
    if cpu is None:
        return []
    n = len(inst.offloaded)
    ctx = sum(r.num_computed_tokens for r in inst.offloaded)
    room = cpu.host_kv_capacity_tokens - cpu.host_kv_tokens
    for r in sorted(gpu_offline, key=lambda x: -x.num_computed_tokens):
        if r.max_output_tokens - r.num_output_tokens < _MIN_TOKENS_LEFT:
            continue
        c = r.num_computed_tokens
        if cpu.host_kv_capacity_tokens > 0 and c > room:
            continue
        if cpu.model.attn_s(n + 1, ctx + c + n + 1, cpu.num_workers) > bound_s:
            return []
        return [r.req_id]
    return []


def cpu_overflow_step(
    pol: TidalPolicy, inst: InstanceState, plan: StepPlan, now: float
) -> StepPlan:
    """One strict step in OmniServe's order (§3.3.1): the decodes OOCO Alg. 2 chose (online
    first), piggybacked CPU-attention decodes (§3.3.6), offline prefill in what is left of the
    HyGen latency budget (§4.1), and one offline decode moved to the CPU (§3.3.5)."""
    tpot = pol.cfg.tpot_slo_s
    budget = pol.tcfg.strict_prefill_budget * tpot
    by_id = {r.req_id: r for r in inst.running}
    dec = [by_id[x] for x in plan.decode if x in by_id]
    off = pick_offloads(inst, [r for r in dec if not r.is_online], budget)
    gone = set(off)
    b = PlanBuilder(inst)
    for r in dec:
        if r.req_id not in gone:
            b.add_decode(r)
    for rid in off:  # its blocks go back before the step (the plan's offload moves it out)
        b.budget.free += by_id[rid].num_blocks
    cpu_dec: tuple[str, ...] = ()
    cpu = inst.cpu
    if cpu is not None and inst.offloaded and cpu.busy_until_s <= now + 1e-12:
        k = piggyback_admission(inst.step_model, b.shape, [len(inst.offloaded)], budget)[0]
        if k > 0:
            order = sorted(inst.offloaded, key=lambda r: r.last_token_s or 0.0)
            cpu_dec = tuple(r.req_id for r in order[:k])
            b.add_tokens(k)
    if pol.tcfg.strict_offline_prefill:
        cands = [
            r
            for r in inst.running
            if not r.is_online and r.phase is Phase.RUNNING and not r.is_decoding
        ]
        cands += [r for r in inst.waiting if not r.is_online]
        for r in cands:
            if b.add_prefill(r, bound_s=budget) == 0:
                break
    if not (b.decode or b.prefill or cpu_dec or off):
        return StepPlan()
    quiet = not (b.prefill or cpu_dec or off or inst.offloaded)
    return StepPlan(
        prefill=b.prefill,
        decode=tuple(b.decode),
        cpu_decode=cpu_dec,
        offload=tuple(off),
        max_repeat=plan.max_repeat if quiet else 1,
    )
