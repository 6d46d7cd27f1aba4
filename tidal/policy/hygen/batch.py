"""HyGen SLO-aware batch formation (papers/hygen.md §4.1 Alg. 1, App. A.1 Alg. 2).

Budgets are tracked the way Alg. 1 does (latency t, chunk c, memory m), but the latency of a
request is charged as the step-time increase it causes, L(B ∪ r) − L(B), which is what
PREDICTOR.predict(r) stands for when the predictor is a batch-latency model (§4.2, eq. 1).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, islice
from operator import attrgetter

from tidal.perf.api import BatchShape, StepModel
from tidal.policy.batch_shape import add_decode, add_prefill, largest_fit


@dataclass(frozen=True, slots=True)
class HyReq:
    """A request as HyGen's scheduler sees it."""

    req_id: Hashable
    prompt_tokens: int  # full prompt length
    computed_tokens: int = 0  # tokens whose KV exists (prompt prefilled + generated)
    held_blocks: int = 0  # KV blocks it holds now

    @property
    def is_decoding(self) -> bool:
        return self.computed_tokens >= self.prompt_tokens


_COMPUTED = attrgetter("computed_tokens")
_HELD = attrgetter("held_blocks")
_ID = attrgetter("req_id")


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class Budget:
    """The running budgets of Alg. 1 (mutated as requests are batched)."""

    model: StepModel
    latency_s: float  # t: the step may take at most this long
    chunk_tokens: int  # c: tokens left in this step's chunk
    free_blocks: int  # m: KV blocks that may still be allocated
    block_size: int
    shape: BatchShape = field(default_factory=BatchShape)
    prefill: dict[Hashable, int] = field(default_factory=dict)  # req_id -> tokens this step
    decode: list[Hashable] = field(default_factory=list)  # req_ids decoding this step
    decode_context: list[int] = field(default_factory=list)  # KV tokens of each `decode` entry
    prefill_context: dict[Hashable, int] = field(default_factory=dict)  # req_id -> KV tokens
    # step_s() of the shape last evaluated (the model is pure: same shape, same latency)
    _memo_shape: BatchShape | None = field(default=None, repr=False, compare=False)
    _memo_s: float = field(default=0.0, repr=False, compare=False)

    @property
    def context(self) -> dict[Hashable, int]:
        """req_id -> KV tokens before the step, for every batched request (built once: the
        decodes are kept as parallel lists, the decision's hot path)."""
        ctx = dict(zip(self.decode, self.decode_context, strict=True))
        ctx.update(self.prefill_context)
        return ctx

    def step_s(self) -> float:
        if self._memo_shape is not self.shape:
            self._memo_s = self.model.step_s(self.shape)
            self._memo_shape = self.shape
        return self._memo_s

    def try_decode(self, r: HyReq, force: bool) -> bool:
        """Alg. 1 lines 6-11: batch one decode if it fits (always in the ONLINE phase)."""
        need = max(0, blocks_for(r.computed_tokens + 1, self.block_size) - r.held_blocks)
        cand = add_decode(self.shape, 1, r.computed_tokens)
        if need > self.free_blocks or (not force and self.model.step_s(cand) > self.latency_s):
            return False
        self.shape, self.free_blocks = cand, self.free_blocks - need
        self.chunk_tokens -= 1
        self.decode.append(r.req_id)
        self.decode_context.append(r.computed_tokens)
        return True

    def add_decodes_forced(self, reqs: Sequence[HyReq]) -> None:
        """`try_decode(r, force=True)` for each of `reqs` in order, with one shape update: the
        latency budget does not apply, so only memory can turn a request away."""
        cs, need = _decode_needs(reqs, self.block_size)
        free = self.free_blocks
        grow = _positive_sum(need)
        if grow <= free:
            # Every decode fits (the common case): batch them all without a per-request loop.
            self.decode.extend([r.req_id for r in reqs])
            self.decode_context.extend(cs)
            n, ctx = len(cs), sum(cs)
            free -= grow
        else:
            n = ctx = 0
            for r, c, k in zip(reqs, cs, need, strict=True):
                if k > free:
                    continue
                if k > 0:
                    free -= k
                n += 1
                ctx += c
                self.decode.append(r.req_id)
                self.decode_context.append(c)
        self.shape = add_decode(self.shape, n, ctx)
        self.free_blocks = free
        self.chunk_tokens -= n

    def add_decode_prefix(self, reqs: Sequence[HyReq]) -> None:
        """Batch the longest prefix of `reqs` whose decodes fit the latency and memory budgets
        (a few model calls, `largest_fit`, instead of one per request)."""
        cs, need = _decode_needs(reqs, self.block_size)
        ctx = list(accumulate(cs, initial=0))
        # Memory and chunk bounds are monotone prefix conditions: cut them first, exactly.
        hi = min(len(reqs), max(0, self.chunk_tokens))
        grow = _positive_sum(need)
        blk: list[int] | None = None
        if grow > self.free_blocks:  # memory may cut the prefix: cumulative blocks per prefix
            blk = list(accumulate([x if x > 0 else 0 for x in need], initial=0))
            hi = min(hi, bisect_right(blk, self.free_blocks) - 1)
        shape = self.shape
        lo, lo_s = largest_fit(
            lambda k: self.model.step_s(add_decode(shape, k, ctx[k])), hi, self.latency_s, ctx
        )
        self.shape = add_decode(self.shape, lo, ctx[lo])
        self._memo_shape, self._memo_s = self.shape, lo_s
        if blk is not None:
            self.free_blocks -= blk[lo]
        elif grow:
            self.free_blocks -= _positive_sum(need[:lo])
        self.chunk_tokens -= lo
        self.decode.extend([r.req_id for r in islice(reqs, lo)])
        self.decode_context.extend(cs[:lo])

    def max_prefill(
        self, r: HyReq, ignore_memory: bool = False, ignore_latency: bool = False
    ) -> int:
        """PREDICTOR.get_max_prefill(t, c, m, r): the longest chunk within every budget
        (`ignore_latency`: within the chunk and memory budgets only)."""
        hi = min(self.chunk_tokens, r.prompt_tokens - r.computed_tokens)
        if not ignore_memory:
            slack = max(0, r.held_blocks * self.block_size - r.computed_tokens)
            hi = min(hi, slack + self.free_blocks * self.block_size)
        if hi <= 0 or ignore_latency:
            return max(0, hi)
        shape, done, now_s = self.shape, r.computed_tokens, self.step_s()
        step_s, limit = self.model.step_s, self.latency_s
        # Latency is monotone in the chunk length, so when one more token already breaks the
        # budget the answer is 0; that is the usual end of a step's offline phase (Alg. 1
        # line 26), so it is asked first, with one model call.
        if hi > 1 and step_s(add_prefill(shape, 1, done)) > limit:
            return 0
        # `largest_fit` is the binary search's answer. k = 0 is the step as it stands
        # (add_prefill returns `shape` itself): no model call.
        return largest_fit(
            lambda k: now_s if k <= 0 else step_s(add_prefill(shape, k, done)), hi, limit
        )[0]

    def take_prefill(self, r: HyReq, tokens: int) -> None:
        need = max(0, blocks_for(r.computed_tokens + tokens, self.block_size) - r.held_blocks)
        self.shape = add_prefill(self.shape, tokens, r.computed_tokens)
        self.chunk_tokens -= tokens
        self.free_blocks -= need
        self.prefill[r.req_id] = tokens
        self.prefill_context[r.req_id] = r.computed_tokens


def slo_aware_schedule(
    budget: Budget,
    decoding: Sequence[HyReq],
    prefill_order: Iterable[HyReq],
    online_phase: bool,
    preempt: Callable[[int], bool] | None = None,
    online_prefill_budgeted: bool = True,
) -> None:
    """HyGen Alg. 1, filling `budget` in place.

    `preempt(blocks_needed)` is PERFORM_PREEMPTION of the online phase: it frees offline memory
    and returns whether anything was freed. NOTE: Alg. 1 preempts whenever l = 0; we preempt only
    when memory is what blocks the chunk, since preempting cannot shorten the step.

    `online_prefill_budgeted=False`: the online phase sizes prefill chunks by the chunk and
    memory budgets only, not the latency budget t (`HygenConfig.online_prefill_budgeted`).
    """
    free_online = online_phase and not online_prefill_budgeted
    if online_phase:  # lines 6-12: every online decode goes in, whatever the budget
        budget.add_decodes_forced(decoding)
    else:  # offline decodes while the budget holds: largest FCFS prefix, by binary search
        budget.add_decode_prefix(decoding)
    for r in prefill_order:  # lines 13-29
        while True:
            n = budget.max_prefill(r, ignore_latency=free_online)
            if n > 0:
                budget.take_prefill(r, n)
                break
            memory_bound = online_phase and preempt is not None and budget.max_prefill(r, True) > 0
            if memory_bound and preempt is not None and preempt(1) and budget.free_blocks > 0:
                continue  # goto TRY_SCHEDULE
            return  # line 26: break out of the request loop


@dataclass(frozen=True)
class HybridBatch:
    """One step as HyGen's two-phase scheduler formed it."""

    prefill: dict[Hashable, int]  # req_id -> prompt tokens to prefill this step
    decode: list[Hashable]  # req_ids decoding one token this step
    preempted: list[Hashable]  # offline req_ids preempted (state retained, back in queue)
    shape: BatchShape  # aggregate shape of the step
    step_s: float  # predicted step latency, seconds
    decode_context: Sequence[int] = ()  # KV tokens before the step of each `decode` entry
    prefill_context: dict[Hashable, int] = field(default_factory=dict)  # the same, prefills

    @cached_property
    def context(self) -> dict[Hashable, int]:
        """req_id -> KV tokens before the step, for every batched request (built on first use:
        the scheduler's callers rarely read it, and it is the decision's largest object)."""
        ctx = dict(zip(self.decode, self.decode_context, strict=True))
        ctx.update(self.prefill_context)
        return ctx


def two_phase_schedule(
    model: StepModel,
    latency_budget_s: float,
    chunk_size: int,
    block_size: int,
    free_blocks: int,
    online_running: Sequence[HyReq],
    online_waiting: Sequence[HyReq],
    offline_running: Sequence[HyReq],
    offline_waiting: Iterable[HyReq],
    online_prefill_budgeted: bool = True,
) -> HybridBatch:
    """HyGen App. A.1 Alg. 2 (ASYNC_SCHEDULER body), synchronously.

    Online phase with memory = free + offline-held (line 11: M_off); offline running requests are
    preempted newest-first if online work took part of their memory (lines 14-16); the offline
    phase then fills the remaining latency/chunk/memory budget: running offline decodes, running
    offline prefills, then waiting offline requests in the given order (App. A.2/A.3).
    """
    off_held = sum([r.held_blocks for r in offline_running])
    b = Budget(model, latency_budget_s, chunk_size, free_blocks + off_held, block_size)
    on_dec, on_pre = _split(online_running)
    slo_aware_schedule(
        b,
        on_dec,
        [*on_pre, *online_waiting],
        online_phase=True,
        online_prefill_budgeted=online_prefill_budgeted,
    )
    # Lines 14-17: give back offline memory the online phase consumed.
    kept: Sequence[HyReq] = offline_running
    preempted: list[Hashable] = []
    if b.free_blocks < off_held:
        left = list(offline_running)
        while b.free_blocks < off_held and left:
            victim = left.pop()  # newest first: the least progress to retain
            off_held -= victim.held_blocks
            preempted.append(victim.req_id)
        kept = left
    b.free_blocks -= off_held
    off_dec, off_pre = _split(kept)
    slo_aware_schedule(b, off_dec, _chain(off_pre, offline_waiting), online_phase=False)
    return HybridBatch(
        b.prefill, b.decode, preempted, b.shape, b.step_s(), b.decode_context, b.prefill_context
    )


def _split(reqs: Sequence[HyReq]) -> tuple[list[HyReq], list[HyReq]]:
    """(decoding, prefilling), order kept; one pass, no property calls (hot path)."""
    dec: list[HyReq] = []
    pre: list[HyReq] = []
    for r in reqs:
        (dec if r.computed_tokens >= r.prompt_tokens else pre).append(r)
    return dec, pre


def _decode_needs(reqs: Sequence[HyReq], bs: int) -> tuple[list[int], list[int]]:
    """(KV tokens, KV blocks one more token adds) per decoding request; the blocks are
    ceil((c + 1) / bs) - held = (c + bs) // bs - held. Comprehensions over plain attribute
    reads: the fastest form on CPython 3.11 (this is the decision's hot path)."""
    cs = [r.computed_tokens for r in reqs]
    need = [(r.computed_tokens + bs) // bs - r.held_blocks for r in reqs]
    return cs, need


def _positive_sum(xs: list[int]) -> int:
    """Sum of the positive entries (blocks to allocate; a negative need frees nothing)."""
    if not xs or min(xs) >= 0:
        return sum(xs)
    return sum([x for x in xs if x > 0])


def _chain(first: Sequence[HyReq], rest: Iterable[HyReq]) -> Iterable[HyReq]:
    yield from first
    yield from rest


def reconcile_on_arrival(
    model: StepModel,
    planned: HybridBatch,
    arrivals: Sequence[HyReq],
    latency_budget_s: float,
    chunk_size: int,
    block_size: int,
    free_blocks: int,
    offline_ids: set[Hashable],
    online_prefill_budgeted: bool = True,
) -> HybridBatch:
    """Alg. 2 SCHEDULER (lines 24-31): the offline plan was made one step ahead by the async
    scheduler; online requests that arrived since are added (UPDATE_BUDGET) and offline entries
    are dropped, last first, until the step fits again (PREEMPT_UNTIL_FIT).

    `free_blocks` are the blocks left once the planned step has allocated its own.
    `online_prefill_budgeted=False` sizes an arrival's chunk as `two_phase_schedule` sizes the
    online phase's (`HygenConfig.online_prefill_budgeted`): by the chunk the step's online work
    leaves and by memory (free blocks plus those the planned offline entries would take, which
    may be dropped), not by the latency budget, which then bounds only what offline keeps."""
    prefill = dict(planned.prefill)
    decode = list(planned.decode)
    used_chunk = sum(prefill.values()) + len(decode)
    # Offline entries in planning order, newest last, so PREEMPT_UNTIL_FIT pops from the end.
    off_entries: list[tuple[Hashable, int]] = [(r, 0) for r in decode if r in offline_ids]
    off_entries += [(r, n) for r, n in prefill.items() if r in offline_ids]
    online_shape = planned.shape
    for rid, n in off_entries:
        online_shape = _without(online_shape, n, planned.context.get(rid, 0))
    b = Budget(
        model, latency_budget_s, chunk_size - used_chunk, free_blocks, block_size, planned.shape
    )
    online_chunk = chunk_size - online_shape.num_prefill_tokens - online_shape.num_decode_reqs
    for r in arrivals:
        # Online first: size its chunk against the budget left by the online part only.
        if online_prefill_budgeted:
            probe = Budget(model, latency_budget_s, chunk_size, 1 << 60, block_size, online_shape)
            n = probe.max_prefill(r)
        else:
            mem = b.free_blocks + sum(
                blocks_for(c + max(k, 1), block_size) - blocks_for(c, block_size)
                for c, k in ((planned.context.get(rid, 0), k) for rid, k in off_entries)
            )
            probe = Budget(model, latency_budget_s, online_chunk, mem, block_size, online_shape)
            n = probe.max_prefill(r, ignore_latency=True)
        if n <= 0:
            continue
        online_chunk -= n
        online_shape = add_prefill(online_shape, n, r.computed_tokens)
        b.shape = add_prefill(b.shape, n, r.computed_tokens)
        b.chunk_tokens -= n
        b.free_blocks -= max(0, blocks_for(r.computed_tokens + n, block_size) - r.held_blocks)
        prefill[r.req_id] = n
    while off_entries and (
        b.step_s() > latency_budget_s or b.chunk_tokens < 0 or b.free_blocks < 0
    ):
        rid, n = off_entries.pop()
        ctx = planned.context.get(rid, 0)
        b.free_blocks += blocks_for(ctx + max(n, 1), block_size) - blocks_for(ctx, block_size)
        if n:
            del prefill[rid]
            b.chunk_tokens += n
        else:
            decode.remove(rid)
            b.chunk_tokens += 1
        b.shape = _without(b.shape, n, ctx)
    context = planned.context
    prefill_context = {r: context[r] for r in prefill if r in context}
    prefill_context.update({r.req_id: r.computed_tokens for r in arrivals if r.req_id in prefill})
    decode_context = [context[r] for r in decode]
    return HybridBatch(
        prefill,
        decode,
        [*planned.preempted],
        b.shape,
        b.step_s(),
        decode_context,
        prefill_context,
    )


def _without(shape: BatchShape, prefill_tokens: int, context_tokens: int) -> BatchShape:
    """`shape` minus one entry: a prefill chunk (prefill_tokens > 0) or a decode."""
    if prefill_tokens:
        return BatchShape(
            shape.num_prefill_tokens - prefill_tokens,
            shape.num_prefill_reqs - 1,
            shape.prefill_attn_pairs - prefill_tokens * (context_tokens + prefill_tokens),
            shape.num_decode_reqs,
            shape.decode_context_tokens,
        )
    return add_decode(shape, -1, -context_tokens)
