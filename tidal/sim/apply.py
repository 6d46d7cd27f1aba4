"""Carrying out one `StepPlan` on one simulated instance: the simulator's kernel of the one
plan interpreter (`tidal.plan.carry_out`), KV block accounting, step time, tokens.

`start_span` carries the plan out (moves, blocks, the step times); `finish_span` credits the
tokens at the end. A plan that cannot be carried out raises `PlanRefused` (a `PolicyError`:
the plan asked for something the instance cannot do) and leaves the instance as it was.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from dataclasses import dataclass, field

from tidal.perf.api import BatchShape
from tidal.plan import (
    EngineCapabilities,
    MigrationMode,
    PlanRefused,
    RefusalReason,
    StepPlan,
    carry_out,
)
from tidal.policy.base import InstanceState, Phase, ReqState
from tidal.sim.recorder import Recorder

_versions = itertools.count(1)
_ON_GPU = frozenset((Phase.RUNNING, Phase.TRANSFER_WAIT))  # phases of `InstanceState.running`


@dataclass(slots=True, eq=False)
class Span:
    """One step, or a run of identical decode-only steps, in flight on one instance."""

    start_s: float
    bounds: list[float]  # end time of each step, seconds
    prefill: list[tuple[ReqState, int]]  # (request, tokens) computed in the first step
    decode: list[ReqState]  # GPU decodes, one token per step
    cpu: list[ReqState] = field(default_factory=list)  # CPU-attention decodes (first step)
    cpu_token_s: float = 0.0  # when the CPU-attention decodes' token is out
    version: int = 0
    k: int = 1  # steps in the span
    layers: int = 0  # > 0: preemptible at this many layer boundaries (one-step spans only)
    discard: bool = False  # cut by a layer-level preemption: credit nothing
    num_aborted: int = 0  # requests the plan ended for lack of KV memory (`abort_no_kv`)

    @property
    def end_s(self) -> float:
        return self.bounds[self.k - 1]

    def truncate(self, now: float) -> bool:
        """End at the first step boundary >= now; True if the span got shorter."""
        if self.k <= 1:
            return False
        j = bisect_left(self.bounds, now, 0, self.k)
        if j >= self.k - 1:
            return False
        self.k = j + 1
        self.version = next(_versions)
        return True

    def preempt_at_layer(self, now: float) -> bool:
        """OOCO §3.4.1: end the step at the next layer boundary after `now`, discarding it.
        True if the span was cut."""
        if self.layers <= 0 or self.discard or self.k != 1 or now >= self.bounds[0]:
            return False
        layer_s = (self.bounds[0] - self.start_s) / self.layers
        done = int((now - self.start_s) / layer_s)
        cut = self.start_s + (done + 1) * layer_s
        if cut >= self.bounds[0]:
            return False
        self.bounds[0] = cut
        self.discard = True
        self.version = next(_versions)
        return True


def _get(reqs: dict[str, ReqState], rid: str, inst: InstanceState, phase: Phase) -> ReqState:
    r = reqs.get(rid)
    if r is None or r.instance_id != inst.instance_id or r.phase is not phase:
        got = "unknown" if r is None else f"{r.phase} on instance {r.instance_id}"
        reason = RefusalReason.UNKNOWN_REQUEST if r is None else RefusalReason.WRONG_STATE
        raise PlanRefused(
            reason,
            f"instance {inst.instance_id}: {rid} must be {phase} here for this plan, is {got}",
        )
    return r


def _alloc(inst: InstanceState, r: ReqState, num_tokens: int) -> None:
    need = inst.blocks_for(num_tokens) - r.num_blocks
    if need > 0:
        if need > inst.num_free_blocks:
            raise PlanRefused(
                RefusalReason.OUT_OF_KV,
                f"instance {inst.instance_id}: out of KV blocks for {r.req_id} "
                f"(needs {need}, {inst.num_free_blocks} free)",
            )
        inst.num_free_blocks -= need
        r.num_blocks += need


def _settle(inst: InstanceState, r: ReqState) -> None:
    """Give back blocks beyond what `r`'s computed tokens need."""
    need = inst.blocks_for(r.num_computed_tokens)
    if r.num_blocks > need:
        inst.num_free_blocks += r.num_blocks - need
        r.num_blocks = need


def _release(inst: InstanceState, r: ReqState) -> None:
    inst.num_free_blocks += r.num_blocks
    r.num_blocks = 0


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
        _release(inst, r)
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
            r = _get(self.reqs, req_id, inst, Phase.RUNNING)
            inst.running.remove(r)
        _release(inst, r)
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
        r = _get(self.reqs, req_id, inst, Phase.RUNNING)
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
        _release(inst, r)
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
        r = _get(self.reqs, req_id, inst, frm)
        _alloc(inst, r, r.num_computed_tokens)
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
        return _compute(self.inst, plan, self.reqs, self.now, self.copy_tokens)


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
        span = _compute(inst, StepPlan(), reqs, now, kernel.copy_tokens)
    span.num_aborted = kernel.num_aborted
    return span


def _compute(
    inst: InstanceState, plan: StepPlan, reqs: dict[str, ReqState], now: float, copy_tokens: int
) -> Span:
    """The compute stage: every check first, then the blocks, so a refusal changes nothing."""
    iid = inst.instance_id
    cpu = inst.cpu
    bs = inst.block_size
    prefill: list[tuple[ReqState, int]] = []
    admitted: list[ReqState] = []
    need_blocks = 0
    for rid, n in plan.prefill.items():
        w = reqs.get(rid)
        if w is not None and w.phase is Phase.WAITING and w.instance_id == iid:
            r = w
            admitted.append(r)
        else:
            r = _get(reqs, rid, inst, Phase.RUNNING)
        if not 0 < n <= r.num_prefill_left:
            raise PlanRefused(
                RefusalReason.BAD_CHUNK, f"{rid}: prefill of {n} tokens, {r.num_prefill_left} left"
            )
        need_blocks += max(0, inst.blocks_for(r.num_computed_tokens + n) - r.num_blocks)
        prefill.append((r, n))

    decode: list[ReqState] = []
    get, running_phase = reqs.get, Phase.RUNNING
    for rid in plan.decode:
        r = get(rid)  # type: ignore[assignment]
        if r is None or r.phase is not running_phase or r.instance_id != iid:
            r = _get(reqs, rid, inst, Phase.RUNNING)  # raises with the reason
        o, c = r.num_output_tokens, r.num_computed_tokens
        if not o or c < r.num_prompt_tokens + o - 1:  # NOTE: `r.is_decoding`, inlined
            raise PlanRefused(
                RefusalReason.WRONG_STATE,
                f"{r.req_id} is not decoding yet ({r.num_prefill_left} to prefill)",
            )
        decode.append(r)
    n = len(decode)
    cpu_reqs = [_get(reqs, rid, inst, Phase.OFFLOADED) for rid in plan.cpu_decode]
    if cpu_reqs:
        assert cpu is not None
        if cpu.busy_until_s > now + 1e-12:
            raise PlanRefused(
                RefusalReason.CPU_WORKERS_BUSY,
                f"CPU-attention workers busy until {cpu.busy_until_s:.6f} s",
            )
    k = 1
    if plan.max_repeat > 1 and n and not prefill and not plan.cpu_decode:
        # Largest k such that every request still has tokens to go and its k new tokens fit
        # in an equal share of the free blocks.
        share = inst.num_free_blocks // n
        k = plan.max_repeat
        for r in decode:
            left = r.max_output_tokens - r.num_output_tokens
            room = (r.num_blocks + share) * bs - r.num_computed_tokens
            if left < k:
                k = left
            if room < k:
                k = room
        if k < 1:
            k = 1
    for r in decode:
        c = r.num_computed_tokens + k
        if -(-c // bs) > r.num_blocks:
            need_blocks += -(-c // bs) - r.num_blocks
    if need_blocks > inst.num_free_blocks:
        raise PlanRefused(
            RefusalReason.OUT_OF_KV,
            f"instance {iid}: the step needs {need_blocks} KV blocks, {inst.num_free_blocks} free",
        )

    # Checked: from here on nothing fails.
    for r in admitted:
        inst.num_waiting_tokens -= r.num_prefill_left
        r.phase = Phase.RUNNING
        inst.running.append(r)
    if admitted:
        wq = inst.waiting
        j = 0
        while j < len(wq) and wq[j].phase is not Phase.WAITING:
            j += 1
        if j == len(admitted):
            del wq[:j]
        else:
            inst.waiting = [x for x in wq if x.phase is Phase.WAITING]
    for r, m in prefill:
        _alloc(inst, r, r.num_computed_tokens + m)
    ctx = 0
    for r in decode:
        c = r.num_computed_tokens
        if -(-(c + k) // bs) > r.num_blocks:
            _alloc(inst, r, c + k)
        ctx += c

    p_tok = p_pairs = p_sq = 0
    for r, m in prefill:
        p_tok += m
        p_pairs += m * (r.num_computed_tokens + m)
        p_sq += m * m
        if r.start_s is None:
            r.start_s = now
    # CPU-attention decodes still run their token-wise layers on the GPU (OmniServe §3.2),
    # but not their attention: they add tokens, not context.
    shape = BatchShape(p_tok, len(prefill), p_pairs, n + len(cpu_reqs), ctx, prefill_sq_tokens=p_sq)
    model = inst.step_model
    t = now + model.step_s(shape) + copy_tokens * inst.kv_bytes_per_token / inst.pcie_bytes_per_s
    bounds = [t]
    for j in range(1, k):
        t += model.step_s(BatchShape(0, 0, 0, n, ctx + j * n))
        bounds.append(t)
    span = Span(now, bounds, prefill, decode, cpu_reqs, version=next(_versions), k=k)
    if k == 1 and not cpu_reqs and plan.layer_cut:
        span.layers = inst.num_layers
    if cpu_reqs:
        assert cpu is not None
        cctx = sum(r.num_computed_tokens for r in cpu_reqs)
        cpu.busy_until_s = now + cpu.model.attn_s(len(cpu_reqs), cctx, cpu.num_workers)
        cpu.pending_tokens += len(cpu_reqs)
        span.cpu_token_s = max(bounds[0], cpu.busy_until_s)
    return span


def finish_span(
    inst: InstanceState, span: Span, now: float, rec: Recorder
) -> tuple[int, list[ReqState]]:
    """Credit the span's tokens at its end. Returns (requests finished, requests whose first
    token just came out and that now decode)."""
    k = span.k
    first: list[ReqState] = []
    done: list[ReqState] = []
    on_tok = off_tok = 0
    if span.discard:  # layer-level preemption: give back what the step had allocated
        for r, _ in span.prefill:
            _settle(inst, r)
        for r in span.decode:
            _settle(inst, r)
        rec.num_layer_preemptions += 1
        rec.record_span(inst.instance_id, span.start_s, span.bounds, 1, 0, 0, 0)
        return 0, first
    for r, m in span.prefill:
        r.num_computed_tokens += m
        if r.num_output_tokens == 0 and r.num_computed_tokens >= r.num_prompt_tokens:
            r.num_output_tokens = 1
            r.first_token_s = r.last_token_s = now
            if r.is_online:
                on_tok += 1
            else:
                off_tok += 1
            (done if r.max_output_tokens <= 1 else first).append(r)
    n_on = 0
    bs = inst.block_size
    b = span.bounds
    # Longest gap between two steps of the span (the first gap is per request, below).
    inner = max(b[j] - b[j - 1] for j in range(1, k)) if k > 1 else 0.0
    for r in span.decode:
        gap = b[0] - r.last_token_s if r.last_token_s is not None else 0.0
        if inner > gap:
            gap = inner
        if gap > r.max_tbt_s:
            r.max_tbt_s = gap
        r.num_computed_tokens += k
        r.num_output_tokens += k
        r.last_token_s = now
        if r.is_online:
            n_on += 1
        # Settle the blocks reserved for the whole span (it may have been cut short).
        need = -(-r.num_computed_tokens // bs)
        if r.num_blocks > need:
            inst.num_free_blocks += r.num_blocks - need
            r.num_blocks = need
        if r.num_output_tokens >= r.max_output_tokens:
            done.append(r)
    on_tok += n_on * k
    off_tok += (len(span.decode) - n_on) * k
    for r in span.cpu:
        if r.last_token_s is not None and span.cpu_token_s - r.last_token_s > r.max_tbt_s:
            r.max_tbt_s = span.cpu_token_s - r.last_token_s
        r.num_computed_tokens += 1
        r.num_output_tokens += 1
        r.last_token_s = span.cpu_token_s
        if inst.cpu is not None:
            inst.cpu.host_kv_tokens += 1
            inst.cpu.pending_tokens -= 1
        off_tok += 1
        if r.num_output_tokens >= r.max_output_tokens:
            done.append(r)
    rec.record_span(inst.instance_id, span.start_s, span.bounds, k, n_on, on_tok, off_tok)
    for r in done:
        r.phase = Phase.FINISHED
        r.finish_s = r.last_token_s
        _release(inst, r)
        if r in span.cpu and inst.cpu is not None:
            inst.cpu.host_kv_tokens -= r.num_computed_tokens
    if done:
        inst.running = [r for r in inst.running if r.phase in _ON_GPU]
        if span.cpu:
            inst.offloaded = [r for r in inst.offloaded if r.phase is Phase.OFFLOADED]
    return len(done), first
