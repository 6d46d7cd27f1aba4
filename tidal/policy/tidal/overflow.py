"""Tidal's CPU-attention overflow on latency-strict instances: OmniServe §3.3.5-§3.3.6 inside
OOCO's strict pool, with HyGen's budgeted offline prefill (§4.1) filling what the GPU has left.

OmniServe §3.3.5 offloads "BE decoding requests that cannot be scheduled on GPUs"; here those
are the offline decodes OOCO Alg. 2 left out of the step. Tidal adds one rule of its own: when
none is left out, a planned offline decode may move to the CPU too, so that the KV blocks it
holds go to offline prefill (OmniServe's order puts BE prefill before BE decode on the GPU,
§3.3.2), but only while KV binds: the strict instance's free blocks cannot take the next chunk
of its waiting offline prompt (`kv_binds`). A request on the CPU makes a token in `num_layers`
steps, not one: its attention result for layer l joins the proj of layer l at the next step
(§3.2.2-§3.2.3, post-attention piggybacking), so one layer a step. Moving a decode the GPU would
run anyway trades a token a step for one every `num_layers` steps; it pays only when its blocks
let work start that otherwise waits for KV. Once nothing binds, offloaded requests come back one
a step (`pick_recall`, §3.3.5's swap back). Either way at most one request moves per step,
because its KV copy lengthens the step, and the copy is charged to the step's budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tidal.policy.base import StepPlan
from tidal.policy.batch_shape import decode_shape
from tidal.policy.omniserve.control import oldest_first, piggyback_admission
from tidal.policy.ooco.config import OocoConfig
from tidal.policy.plan_builder import PlanBuilder
from tidal.policy.state import InstanceState, Phase, ReqState
from tidal.policy.tidal.config import TidalConfig


class OverflowPolicy(Protocol):
    """What a strict step's overflow reads of its policy (`TidalPolicy`)."""

    cfg: OocoConfig
    tcfg: TidalConfig

    def strict_budget(self, inst: InstanceState, now: float) -> float: ...


def host_room(inst: InstanceState) -> int | None:
    """Host KV tokens still free for offloads, or None when host memory is unlimited."""
    cpu = inst.cpu
    if cpu is None or cpu.host_kv_capacity_tokens <= 0:
        return None
    return cpu.host_kv_capacity_tokens - cpu.host_kv_tokens


def pick_offloads(
    inst: InstanceState,
    left_out: Sequence[ReqState],
    planned: Sequence[ReqState],
    bound_s: float,
    room: int | None,
) -> list[str]:
    """§3.3.5: the offline decode to move to the CPU-attention workers: those Alg. 2 left out
    first, then (Tidal's rule) planned ones; longest context first within each, skipping any
    whose CPU step over everything offloaded would pass `bound_s` or whose KV (plus its next
    token) does not fit the host's `room` (None: unlimited). At most one per step."""
    cpu = inst.cpu
    if cpu is None:
        return []
    n = len(inst.offloaded)
    ctx = sum(r.num_computed_tokens for r in inst.offloaded)
    for group in (left_out, planned):
        for r in sorted(group, key=lambda x: -x.num_computed_tokens):
            c = r.num_computed_tokens
            if room is not None and c + 1 > room:
                continue
            if cpu.model.attn_s(n + 1, ctx + c + n + 1, cpu.num_workers) > bound_s:
                continue
            return [r.req_id]
    return []


def offline_prefill_candidates(inst: InstanceState) -> list[ReqState]:
    """Offline prompts a strict step may prefill (HyGen §4.1 offline phase): partially
    prefilled ones first, then the waiting queue."""
    cands = [
        r
        for r in inst.running
        if not r.is_online and r.phase is Phase.RUNNING and not r.is_decoding
    ]
    return cands + [r for r in inst.waiting if not r.is_online]


def kv_binds(inst: InstanceState, cands: Sequence[ReqState]) -> bool:
    """True when offline prefill on `inst` waits for KV: the free blocks (and the room left in
    its own last block) cannot take the next chunk of the first candidate."""
    if not cands:
        return False
    r = cands[0]
    want = min(r.num_prefill_left, inst.chunk_size)
    have = inst.num_free_blocks * inst.block_size + r.num_blocks * inst.block_size
    return have - r.num_computed_tokens < want


def pick_recall(
    pol: OverflowPolicy,
    inst: InstanceState,
    dec: Sequence[ReqState],
    left_out: Sequence[ReqState],
    cands: Sequence[ReqState],
) -> list[ReqState]:
    """OmniServe §3.3.5: "if there are not enough BE decoding requests on the GPUs and the SLO
    is still maintained, ... swap BE decoding requests back to GPUs, provided there is available
    GPU memory". Here: while nothing binds (no offline prompt waits on this instance, Alg. 2
    left no decode out) the offloaded request whose token is oldest comes back, if its KV and
    next token leave `strict_kv_reserve` of the blocks free and the decodes with it stay within
    OOCO's `migration_margin` x TPOT (the pull test, §3.4.3), so the next step keeps it on the
    GPU rather than moving it out again. One per step; its copy is charged to the step."""
    if cands or left_out or not inst.offloaded:
        return []
    rid = oldest_first(inst.offloaded, 1)[0]
    r = next(x for x in inst.offloaded if x.req_id == rid)
    reserve = int(pol.tcfg.strict_kv_reserve * inst.num_blocks)
    if inst.num_free_blocks - inst.blocks_for(r.num_computed_tokens + 1) < reserve:
        return []
    shape = decode_shape([x.num_computed_tokens for x in dec] + [r.num_computed_tokens])
    if inst.step_model.step_s(shape) > pol.cfg.migration_margin * pol.cfg.tpot_slo_s:
        return []
    return [r]


def cpu_overflow_step(
    pol: OverflowPolicy, inst: InstanceState, plan: StepPlan, now: float
) -> StepPlan:
    """One strict step: the decodes OOCO Alg. 2 chose (online first) less the one moved to the
    CPU, the piggybacked CPU-attention decodes whose attention is due (§3.3.6), the KV copy of
    the moved request, then offline prefill in what is left of the latency budget (HyGen
    §4.1). Everything but the Alg. 2 decodes stays within `strict_prefill_budget` x TPOT."""
    budget = pol.strict_budget(inst, now)
    by_id = {r.req_id: r for r in inst.running}
    dec = [by_id[x] for x in plan.decode if x in by_id]
    chosen = set(plan.decode)
    left_out = [
        r
        for r in inst.running
        if not r.is_online and r.phase is Phase.RUNNING and r.is_decoding and r.req_id not in chosen
    ]
    cpu = inst.cpu
    due = cpu is not None and bool(inst.offloaded) and cpu.busy_until_s <= now + 1e-12
    raw_room = room = host_room(inst)
    if room is not None and due:
        room -= len(inst.offloaded)  # each CPU decode this step adds one host KV token
    cands = offline_prefill_candidates(inst) if pol.tcfg.strict_offline_prefill else []
    planned_off = [r for r in dec if not r.is_online] if kv_binds(inst, cands) else []
    off = pick_offloads(inst, left_out, planned_off, budget, room)

    back = pick_recall(pol, inst, dec, left_out, cands) if due and not off else []

    def build(moved: list[str]) -> tuple[PlanBuilder, tuple[str, ...], float]:
        b = PlanBuilder(inst)
        for r in dec:
            if r.req_id not in moved:
                b.add_decode(r)
        for rid in moved:  # its blocks go back before the step (the plan's offload moves it)
            b.budget.free += by_id[rid].num_blocks
        for r in back:  # its KV comes back before the step (the plan's recall)
            b.budget.take(r, 0)
        moved_tokens = sum(by_id[rid].num_computed_tokens for rid in moved)
        copied = moved_tokens + sum(r.num_computed_tokens for r in back)
        cpu_dec: tuple[str, ...] = ()
        if due:
            stay = [r for r in inst.offloaded if r not in back]
            k = piggyback_admission(inst.step_model, b.shape, [len(stay)], budget)[0]
            if raw_room is not None:  # new host tokens must fit beside the moved KV
                k = min(k, max(0, raw_room - moved_tokens))
            if k > 0:
                cpu_dec = oldest_first(stay, k)
                b.add_tokens(len(cpu_dec))
        per_token = inst.kv_bytes_per_token / inst.pcie_bytes_per_s
        copy_s = copied * per_token
        return b, cpu_dec, copy_s

    b, cpu_dec, copy_s = build(off)
    if (off or back) and b.step_s() + copy_s > budget:  # the copy does not fit this step
        off, back = [], []
        b, cpu_dec, copy_s = build(off)
    for r in cands:
        if b.add_prefill(r, bound_s=budget - copy_s) == 0:
            break
    if not (b.decode or b.prefill or cpu_dec or off or back):
        return StepPlan()
    quiet = not (b.prefill or cpu_dec or off or back or inst.offloaded)
    return StepPlan(
        prefill=b.prefill,
        decode=tuple(b.decode),
        cpu_decode=cpu_dec,
        offload=tuple(off),
        recall=tuple(r.req_id for r in back),
        max_repeat=plan.max_repeat if quiet else 1,
    )
