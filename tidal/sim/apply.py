"""Carrying out one `StepPlan` on one simulated instance: the simulator's kernel of the one
plan interpreter (`tidal.plan.carry_out`), KV block accounting, step time, tokens.

`start_span` carries the plan out: its moves here (`SimKernel`), then its step (blocks, step
times: `tidal.sim.span`); `finish_span` (`tidal.sim.span`) credits the tokens at the end.
Checkpoints (ConServe): `checkpoint` copies an offline request's new full blocks to host
memory beside the step (the step lasts the longer of the two); `release` frees its GPU blocks
at once and parks it swapped with its checkpointed tokens, the rest lost; `swap_in` copies the
checkpoint back before the step, and the lost tail is prefilled again. A plan
that cannot be carried out raises `PlanRefused` (a `PolicyError`: the plan asked for something
the instance cannot do) and leaves the instance as it was.
A chunk cut at a layer boundary (`tidal.sim.resume`) goes with its KV: recompute, release and
offload drop it, a swap carries it out and back with the rest.
"""

from __future__ import annotations

from tidal.plan import (
    EngineCapabilities,
    MigrationMode,
    PlanRefused,
    RefusalReason,
    StepPlan,
    carry_out,
)
from tidal.policy.class_preempt import class_preemption
from tidal.policy.state import InstanceState, Phase, ReqState, order_waiting
from tidal.sim.recorder import Recorder
from tidal.sim.resume import Cuts
from tidal.sim.span import (
    Span,
    alloc_blocks,
    compute_span,
    drop_checkpoint,
    release_blocks,
    require,
)


class SimKernel:
    """Each stage of a plan on the simulator's records (`tidal.plan.PlanKernel`). Moves keep
    the instance's lists in step at once, so an undo (`tidal.plan.carry_out`) restores them."""

    __slots__ = (
        "bg_copy_tokens",
        "capabilities",
        "copy_tokens",
        "cuts",
        "head",
        "inst",
        "now",
        "num_aborted",
        "rec",
        "reqs",
    )

    def __init__(
        self,
        inst: InstanceState,
        reqs: dict[str, ReqState],
        now: float,
        rec: Recorder,
        cuts: Cuts | None = None,
    ) -> None:
        self.inst = inst
        self.reqs = reqs
        self.now = now
        self.rec = rec
        self.cuts: Cuts = {} if cuts is None else cuts  # chunks cut at a layer boundary
        self.copy_tokens = 0  # KV tokens crossing PCIe before the step
        self.bg_copy_tokens = 0  # KV tokens checkpointed to host beside the step
        self.head = 0  # where the next recomputed request goes in the waiting queue
        self.num_aborted = 0
        self.capabilities = EngineCapabilities(
            layer_cut=inst.num_layers > 1,
            num_layers=inst.num_layers,
            migration=MigrationMode.KV,
            cpu_attention=inst.cpu is not None,
            priority=True,
            kv_checkpoint=inst.ckpt_capacity_tokens > 0,
        )

    def is_online(self, req_id: str) -> bool:
        return self.reqs[req_id].is_online

    def priority(self, req_id: str) -> int:
        return self.reqs[req_id].priority

    def top_priority(self) -> int | None:
        inst = self.inst
        return max(
            (r.priority for r in (*inst.waiting, *inst.running) if r.is_online), default=None
        )

    def abort_no_kv(self, req_id: str) -> None:
        inst = self.inst
        r = self.reqs.get(req_id)
        if r is None or r.instance_id != inst.instance_id:
            raise PlanRefused(RefusalReason.UNKNOWN_REQUEST, f"{req_id} is not here")
        for lst in (inst.waiting, inst.running, inst.swapped, inst.offloaded):
            if r in lst:
                lst.remove(r)
        if r.phase is Phase.WAITING:
            inst.num_waiting_tokens -= r.num_prefill_left
        parked = r.phase in (Phase.SWAPPED, Phase.OFFLOADED) and not r.is_released
        if parked and inst.cpu is not None:
            inst.cpu.host_kv_tokens -= r.num_computed_tokens
        release_blocks(inst, r)
        drop_checkpoint(inst, r)
        self.cuts.pop(req_id, None)
        r.is_released = False
        r.phase = Phase.REJECTED
        r.finish_s = self.now
        self.rec.rejections["out_of_kv"] += 1
        self.num_aborted += 1

    def recompute(self, req_id: str) -> None:
        inst = self.inst
        r = self.reqs.get(req_id)
        if r is not None and r.phase is Phase.OFFLOADED and r.instance_id == inst.instance_id:
            inst.offloaded.remove(r)
            if inst.cpu is not None:
                inst.cpu.host_kv_tokens -= r.num_computed_tokens
        else:
            r = require(self.reqs, req_id, inst, Phase.RUNNING)
            inst.running.remove(r)
        release_blocks(inst, r)
        drop_checkpoint(inst, r)
        self.cuts.pop(req_id, None)
        self.rec.num_recompute_lost_tokens += r.num_computed_tokens
        r.num_computed_tokens = 0
        r.phase = Phase.WAITING
        r.queued_s = self.now
        r.num_preemptions += 1
        inst.num_waiting_tokens += r.num_prefill_left
        # vLLM recompute: preempted requests go first, at the head of their priority
        wq, i = inst.waiting, self.head
        while i < len(wq) and wq[i].priority > r.priority:
            i += 1
        wq.insert(i, r)
        order_waiting(wq, i)
        self.head = i + 1
        self.rec.num_preemptions += 1

    def _park(self, req_id: str, to: Phase) -> None:
        inst, cpu = self.inst, self.inst.cpu
        r = require(self.reqs, req_id, inst, Phase.RUNNING)
        if to is Phase.OFFLOADED and (cpu is None or not r.is_decoding):
            raise PlanRefused(
                RefusalReason.WRONG_STATE,
                f"cannot offload {req_id}: no CPU workers or not decoding",
            )
        if cpu is not None:
            cap = cpu.host_kv_capacity_tokens
            if 0 < cap < cpu.host_kv_tokens + r.num_computed_tokens:
                raise PlanRefused(
                    RefusalReason.HOST_MEMORY_FULL,
                    f"host memory full: {cpu.host_kv_tokens} KV tokens parked, capacity {cap}",
                )
            cpu.host_kv_tokens += r.num_computed_tokens
        release_blocks(inst, r)
        inst.running.remove(r)
        r.phase = to
        (inst.swapped if to is Phase.SWAPPED else inst.offloaded).append(r)
        self.copy_tokens += r.num_computed_tokens
        cut = self.cuts.get(req_id)
        if cut is not None:  # a swap keeps the cut chunk (its KV goes too); CPU attention not
            if to is Phase.SWAPPED:
                self.copy_tokens += cut[0]
            else:
                del self.cuts[req_id]
        if to is Phase.SWAPPED:
            self.rec.num_swaps += 1
        else:
            self.rec.num_offloads += 1

    def _unpark(self, req_id: str, frm: Phase) -> None:
        inst, cpu = self.inst, self.inst.cpu
        r = require(self.reqs, req_id, inst, frm)
        cut = self.cuts.get(req_id, (0, 0))[0]  # a swapped cut chunk comes back with the rest
        alloc_blocks(inst, r, r.num_computed_tokens + cut)
        (inst.swapped if frm is Phase.SWAPPED else inst.offloaded).remove(r)
        r.phase = Phase.RUNNING
        inst.running.append(r)
        self.copy_tokens += r.num_computed_tokens + cut
        if r.is_released:  # the restore: its checkpoint back; it stays in host memory
            r.is_released = False
            self.rec.num_restored_tokens += r.num_computed_tokens
        elif cpu is not None:
            cpu.host_kv_tokens -= r.num_computed_tokens

    def checkpoint(self, req_id: str) -> None:
        """The request's full blocks not yet saved, copied to host memory beside the step."""
        inst = self.inst
        r = self._offline_running(req_id)
        full = r.num_computed_tokens // inst.block_size * inst.block_size
        new = full - r.num_checkpointed_tokens
        if new <= 0:
            return
        if inst.ckpt_tokens + new > inst.ckpt_capacity_tokens:
            raise PlanRefused(
                RefusalReason.HOST_MEMORY_FULL,
                f"checkpoint of {req_id}: {new} tokens more, {inst.ckpt_tokens} of "
                f"{inst.ckpt_capacity_tokens} held",
            )
        inst.ckpt_tokens += new
        r.num_checkpointed_tokens = full
        self.bg_copy_tokens += new
        self.rec.num_checkpoint_tokens += new

    def release(self, req_id: str) -> None:
        """Free a checkpointed request's GPU blocks now; it waits swapped with its checkpoint,
        the tokens past it lost (prefilled again after `swap_in`)."""
        inst = self.inst
        r = self._offline_running(req_id)
        if not r.num_checkpointed_tokens:
            raise PlanRefused(
                RefusalReason.WRONG_STATE, f"{req_id} holds no checkpoint: recompute it instead"
            )
        self.rec.num_checkpoint_lost_tokens += r.num_computed_tokens - r.num_checkpointed_tokens
        release_blocks(inst, r)
        self.cuts.pop(req_id, None)  # past the checkpoint: computed again
        inst.running.remove(r)
        r.num_computed_tokens = r.num_checkpointed_tokens
        r.phase = Phase.SWAPPED
        r.is_released = True
        r.num_preemptions += 1
        inst.swapped.append(r)
        self.rec.num_releases += 1

    def _offline_running(self, req_id: str) -> ReqState:
        r = require(self.reqs, req_id, self.inst, Phase.RUNNING)
        if r.is_online:
            raise PlanRefused(RefusalReason.ONLINE_EVICTION, f"{req_id} is online")
        return r

    def swap_out(self, req_id: str) -> None:
        self._park(req_id, Phase.SWAPPED)

    def offload(self, req_id: str) -> None:
        self._park(req_id, Phase.OFFLOADED)

    def swap_in(self, req_id: str) -> None:
        self._unpark(req_id, Phase.SWAPPED)

    def recall(self, req_id: str) -> None:
        self._unpark(req_id, Phase.OFFLOADED)

    def run(self, plan: StepPlan) -> Span:
        return compute_span(
            self.inst, plan, self.reqs, self.now, self.copy_tokens, self.bg_copy_tokens, self.cuts
        )


def evict_for_classes(
    inst: InstanceState,
    reqs: dict[str, ReqState],
    now: float,
    rec: Recorder,
    cuts: Cuts | None = None,
) -> None:
    """At `inst`'s step boundary, before its policy plans: a higher class waiting for KV evicts
    lower ones (`tidal.policy.class_preempt`, the live instance's rule), at no cost in time, as
    the live instance carries out an eviction-only plan with no compute step."""
    pre = class_preemption(inst)
    if pre is None:
        return
    carry_out(SimKernel(inst, reqs, now, rec, cuts), pre.plan)
    rec.num_class_evictions += sum(1 for v in pre.victims if reqs[v.req_id].is_online)


def start_span(
    inst: InstanceState,
    plan: StepPlan,
    reqs: dict[str, ReqState],
    now: float,
    rec: Recorder,
    cuts: Cuts | None = None,
) -> Span:
    """Carry out `plan` through the one interpreter (`tidal.plan.carry_out`): its moves, its
    blocks, and the time of its step(s). `PlanRefused` (a `PolicyError`) when it cannot be;
    nothing of it is then done. `cuts`: the run's chunks cut at a layer boundary."""
    kernel = SimKernel(inst, reqs, now, rec, cuts)
    out = carry_out(kernel, plan)
    span = out.result
    if span is None:  # moves only: an empty step, plus the PCIe copies
        span = compute_span(
            inst, StepPlan(), reqs, now, kernel.copy_tokens, kernel.bg_copy_tokens, kernel.cuts
        )
    span.num_aborted = kernel.num_aborted
    return span
