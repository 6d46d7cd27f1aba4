"""Carrying out one `StepPlan` on one simulated instance: the simulator's kernel of the one
plan interpreter (`tidal.plan.carry_out`), KV block accounting, step time, tokens.

`start_span` carries the plan out: its moves here (`SimKernel`), then its step (blocks, step
times: `tidal.sim.span`); `finish_span` (`tidal.sim.span`) credits the tokens at the end. A plan
that cannot be carried out raises `PlanRefused` (a `PolicyError`: the plan asked for something
the instance cannot do) and leaves the instance as it was.
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
from tidal.policy.state import InstanceState, Phase, ReqState
from tidal.sim.recorder import Recorder
from tidal.sim.span import Span, alloc_blocks, compute_span, release_blocks, require


class SimKernel:
    """Each stage of a plan on the simulator's records (`tidal.plan.PlanKernel`). Moves keep
    the instance's lists in step at once, so an undo (`tidal.plan.carry_out`) restores them."""

    __slots__ = ("capabilities", "copy_tokens", "head", "inst", "now", "num_aborted", "rec", "reqs")

    def __init__(
        self, inst: InstanceState, reqs: dict[str, ReqState], now: float, rec: Recorder
    ) -> None:
        self.inst = inst
        self.reqs = reqs
        self.now = now
        self.rec = rec
        self.copy_tokens = 0  # KV tokens crossing PCIe before the step
        self.head = 0  # where the next recomputed request goes in the waiting queue
        self.num_aborted = 0
        self.capabilities = EngineCapabilities(
            layer_cut=inst.num_layers > 1,
            num_layers=inst.num_layers,
            migration=MigrationMode.KV,
            cpu_attention=inst.cpu is not None,
            priority=True,
        )

    def is_online(self, req_id: str) -> bool:
        return self.reqs[req_id].is_online

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
        if r.phase in (Phase.SWAPPED, Phase.OFFLOADED) and inst.cpu is not None:
            inst.cpu.host_kv_tokens -= r.num_computed_tokens
        release_blocks(inst, r)
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
        r.num_computed_tokens = 0
        r.phase = Phase.WAITING
        r.queued_s = self.now
        r.num_preemptions += 1
        inst.num_waiting_tokens += r.num_prefill_left
        inst.waiting.insert(self.head, r)  # vLLM recompute: preempted requests go first
        self.head += 1
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
        if to is Phase.SWAPPED:
            self.rec.num_swaps += 1
        else:
            self.rec.num_offloads += 1

    def _unpark(self, req_id: str, frm: Phase) -> None:
        inst, cpu = self.inst, self.inst.cpu
        r = require(self.reqs, req_id, inst, frm)
        alloc_blocks(inst, r, r.num_computed_tokens)
        (inst.swapped if frm is Phase.SWAPPED else inst.offloaded).remove(r)
        r.phase = Phase.RUNNING
        inst.running.append(r)
        self.copy_tokens += r.num_computed_tokens
        if cpu is not None:
            cpu.host_kv_tokens -= r.num_computed_tokens

    def swap_out(self, req_id: str) -> None:
        self._park(req_id, Phase.SWAPPED)

    def offload(self, req_id: str) -> None:
        self._park(req_id, Phase.OFFLOADED)

    def swap_in(self, req_id: str) -> None:
        self._unpark(req_id, Phase.SWAPPED)

    def recall(self, req_id: str) -> None:
        self._unpark(req_id, Phase.OFFLOADED)

    def run(self, plan: StepPlan) -> Span:
        return compute_span(self.inst, plan, self.reqs, self.now, self.copy_tokens)


def start_span(
    inst: InstanceState, plan: StepPlan, reqs: dict[str, ReqState], now: float, rec: Recorder
) -> Span:
    """Carry out `plan` through the one interpreter (`tidal.plan.carry_out`): its moves, its
    blocks, and the time of its step(s). `PlanRefused` (a `PolicyError`) when it cannot be;
    nothing of it is then done."""
    kernel = SimKernel(inst, reqs, now, rec)
    out = carry_out(kernel, plan)
    span = out.result
    if span is None:  # moves only: an empty step, plus the PCIe copies
        span = compute_span(inst, StepPlan(), reqs, now, kernel.copy_tokens)
    span.num_aborted = kernel.num_aborted
    return span
