"""One step in flight on one simulated instance: its compute stage, its time, its tokens.

A `Span` is one step, or a run of identical decode-only steps (`StepPlan.max_repeat`), that an
instance is running. `compute_span` is a plan's compute stage (every check first, then the KV
blocks, then the step times from the instance's `StepModel`); `finish_span` credits the tokens
when the span ends. The moves a plan makes before its step (preempt, swap, offload) are carried
out in `tidal.sim.apply`. A step cut at a layer boundary credits no tokens: its chunks keep the
layers they did and resume later (OOCO §3.4.1, `tidal.sim.resume`).
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from tidal.perf.api import BatchShape
from tidal.plan import PlanRefused, RefusalReason, StepPlan
from tidal.policy.state import InstanceState, Phase, ReqState
from tidal.sim.recorder import Recorder
from tidal.sim.resume import Cuts, fixed_s, layer_ends, layered_step

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
    layer_t0: float = 0.0  # when its first layer starts (after the copies and the fixed part)
    segs: list[tuple[int, float]] = field(default_factory=list)  # (first layer, s per layer)
    cut_layer: int = 0  # > 0: cut by a layer-level preemption after this many layers
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

    def rescale(self, now: float, ratio: float) -> bool:
        """What is left of the span after `now` takes `ratio` times as long (its device's
        share changed, `tidal.sim.sharing`): every boundary after `now`, and the layers' start,
        so the layer boundaries still ahead move with it. True if its end moved."""
        b = self.bounds
        moved = False
        for j in range(self.k):
            if b[j] > now:
                b[j] = now + ratio * (b[j] - now)
                moved = True
        if self.layers:  # layer_ends() spaces the layers from here to the end, in proportion
            self.layer_t0 = now + ratio * (self.layer_t0 - now)
        if moved:
            self.version = next(_versions)
        return moved

    def preempt_at_layer(self, now: float) -> bool:
        """OOCO §3.4.1: end the step at the next layer boundary after `now`; its chunks keep
        the layers done and resume later (`finish_span`). True if the span was cut."""
        if self.layers <= 0 or self.cut_layer or self.k != 1 or now >= self.bounds[0]:
            return False
        first = self.segs[0][0]
        ends = layer_ends(self.layer_t0, self.bounds[0], self.segs, self.layers)
        j = bisect_right(ends, now)  # layers done by `now`; the one running ends, then the cut
        done = first + j + 1
        if done >= self.layers or ends[j] >= self.bounds[0]:
            return False
        self.bounds[0] = ends[j]
        self.cut_layer = done
        self.version = next(_versions)
        return True


def require(reqs: dict[str, ReqState], rid: str, inst: InstanceState, phase: Phase) -> ReqState:
    """The request `rid`, which the plan needs in `phase` on `inst`; `PlanRefused` if not."""
    r = reqs.get(rid)
    if r is None or r.instance_id != inst.instance_id or r.phase is not phase:
        got = "unknown" if r is None else f"{r.phase} on instance {r.instance_id}"
        reason = RefusalReason.UNKNOWN_REQUEST if r is None else RefusalReason.WRONG_STATE
        raise PlanRefused(
            reason,
            f"instance {inst.instance_id}: {rid} must be {phase} here for this plan, is {got}",
        )
    return r


def alloc_blocks(inst: InstanceState, r: ReqState, num_tokens: int) -> None:
    """Give `r` the blocks for `num_tokens` tokens of KV; `PlanRefused` if `inst` lacks them."""
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


def release_blocks(inst: InstanceState, r: ReqState) -> None:
    """Give back all of `r`'s GPU blocks."""
    inst.num_free_blocks += r.num_blocks
    r.num_blocks = 0


def drop_checkpoint(inst: InstanceState, r: ReqState) -> None:
    """Free `r`'s host checkpoint (it ended, was recomputed or leaves the instance)."""
    inst.ckpt_tokens -= r.num_checkpointed_tokens
    r.num_checkpointed_tokens = 0


def compute_span(
    inst: InstanceState,
    plan: StepPlan,
    reqs: dict[str, ReqState],
    now: float,
    copy_tokens: int,
    bg_copy_tokens: int = 0,
    cuts: Cuts | None = None,
) -> Span:
    """The compute stage: every check first, then the blocks, so a refusal changes nothing.
    `copy_tokens` cross PCIe before the step (swaps, restores); `bg_copy_tokens` (checkpoints)
    beside it, on the copy engine: the step lasts the longer of the two. A request with a chunk
    in `cuts` runs that chunk, whatever size the plan gave it (as the live executor does), from
    the layer where it was cut (`tidal.sim.resume`)."""
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
            r = require(reqs, rid, inst, Phase.RUNNING)
            if cuts and rid in cuts:
                n = cuts[rid][0]
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
            r = require(reqs, rid, inst, Phase.RUNNING)  # raises with the reason
        o, c = r.num_output_tokens, r.num_computed_tokens
        if not o or c < r.num_prompt_tokens + o - 1:  # NOTE: `r.is_decoding`, inlined
            raise PlanRefused(
                RefusalReason.WRONG_STATE,
                f"{r.req_id} is not decoding yet ({r.num_prefill_left} to prefill)",
            )
        decode.append(r)
    n = len(decode)
    cpu_reqs = [require(reqs, rid, inst, Phase.OFFLOADED) for rid in plan.cpu_decode]
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
        alloc_blocks(inst, r, r.num_computed_tokens + m)
    ctx = 0
    for r in decode:
        c = r.num_computed_tokens
        if -(-(c + k) // bs) > r.num_blocks:
            alloc_blocks(inst, r, c + k)
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
    bw = inst.pcie_bytes_per_s
    segs: list[tuple[int, float]] = []
    fixed = 0.0
    if cuts and (
        any(r.req_id in cuts for r, _ in prefill) or any(r.req_id in cuts for r in decode)
    ):  # resumed chunks run only their layers left (OOCO §3.4.1)
        step_s, fixed, segs = layered_step(
            model,
            [(cuts.get(r.req_id, (0, 0))[1], m, r.num_computed_tokens) for r, m in prefill],
            [(cuts.get(r.req_id, (0, 0))[1], r.num_computed_tokens) for r in decode],
            len(cpu_reqs),
            inst.num_layers,
        )
    else:
        step_s = model.step_s(shape)
    compute_s = step_s
    if bg_copy_tokens:  # ConServe: the checkpoint copy overlaps the step
        step_s = max(step_s, bg_copy_tokens * inst.kv_bytes_per_token / bw)
    copy_s = copy_tokens * inst.kv_bytes_per_token / bw
    t = now + step_s + copy_s
    bounds = [t]
    for j in range(1, k):
        t += model.step_s(BatchShape(0, 0, 0, n, ctx + j * n))
        bounds.append(t)
    span = Span(now, bounds, prefill, decode, cpu_reqs, version=next(_versions), k=k)
    if k == 1 and not cpu_reqs and plan.layer_cut:
        span.layers = inst.num_layers
        if not segs:
            fixed = fixed_s(model, shape)
            segs = [(0, max(0.0, compute_s - fixed) / inst.num_layers)]
        span.layer_t0 = now + copy_s + fixed
        span.segs = segs
    if cpu_reqs:
        assert cpu is not None
        cctx = sum(r.num_computed_tokens for r in cpu_reqs)
        cpu.busy_until_s = now + cpu.model.attn_s(len(cpu_reqs), cctx, cpu.num_workers)
        cpu.pending_tokens += len(cpu_reqs)
        span.cpu_token_s = max(bounds[0], cpu.busy_until_s)
    return span


def finish_span(
    inst: InstanceState, span: Span, now: float, rec: Recorder, cuts: Cuts | None = None
) -> tuple[int, list[ReqState]]:
    """Credit the span's tokens at its end. Returns (requests finished, requests whose first
    token just came out and that now decode). A span cut at a layer boundary credits none: its
    chunks keep their blocks and the layers done, in `cuts` (OOCO §3.4.1, as the engines)."""
    k = span.k
    first: list[ReqState] = []
    done: list[ReqState] = []
    on_tok = off_tok = 0
    if span.cut_layer:
        if cuts is None:
            raise ValueError("a step cut at a layer boundary needs `cuts` to keep its chunks")
        layer = span.cut_layer
        for r, m in span.prefill:
            if cuts.get(r.req_id, (0, 0))[1] < layer:  # a chunk that ran no layer stays as it was
                cuts[r.req_id] = (m, layer)
        for r in span.decode:
            if cuts.get(r.req_id, (0, 0))[1] < layer:
                cuts[r.req_id] = (1, layer)
        rec.num_layer_preemptions += 1
        rec.num_layer_cut_tokens += sum(m for _, m in span.prefill)
        rec.record_span(inst.instance_id, span.start_s, span.bounds, 1, 0, 0, 0)
        return 0, first
    if cuts:
        for r, _ in span.prefill:
            cuts.pop(r.req_id, None)
        for r in span.decode:
            cuts.pop(r.req_id, None)
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
        release_blocks(inst, r)
        if r.num_checkpointed_tokens:
            drop_checkpoint(inst, r)
        if r in span.cpu and inst.cpu is not None:
            inst.cpu.host_kv_tokens -= r.num_computed_tokens
    if done:
        inst.running = [r for r in inst.running if r.phase in _ON_GPU]
        if span.cpu:
            inst.offloaded = [r for r in inst.offloaded if r.phase is Phase.OFFLOADED]
    return len(done), first
