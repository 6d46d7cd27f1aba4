"""Glue between the pure algorithms and the policy interface (`tidal.policy.base`): views of an
instance's requests and a chunked-prefill filler shared by the OOCO, HyGen, TaiChi, OmniServe and
Tidal policies. No decisions live here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tidal.perf.api import BatchShape, StepModel
from tidal.policy.base import BlockBudget, StepPlan
from tidal.policy.batch_shape import add_decode, add_prefill
from tidal.policy.state import InstanceState, Phase, ReqState


def split_running(inst: InstanceState) -> tuple[list[ReqState], list[ReqState]]:
    """(decoding, prefilling) requests with KV on the GPU."""
    dec: list[ReqState] = []
    pre: list[ReqState] = []
    for r in inst.running:
        (dec if r.is_decoding else pre).append(r)
    return dec, pre


class PlanBuilder:
    """Accumulates one StepPlan while tracking its BatchShape, chunk and KV blocks."""

    __slots__ = ("budget", "chunk_left", "decode", "model", "prefill", "shape")

    def __init__(self, inst: InstanceState, chunk: int | None = None) -> None:
        self.model: StepModel = inst.step_model
        self.budget = BlockBudget(inst)
        self.chunk_left = inst.chunk_size if chunk is None else chunk
        self.shape = BatchShape()
        self.prefill: dict[str, int] = {}
        self.decode: list[str] = []

    def step_s(self) -> float:
        return self.model.step_s(self.shape)

    def add_decode(self, r: ReqState, bound_s: float | None = None) -> bool:
        """Decode `r` if a block is free (and the step stays within `bound_s`, if given)."""
        cand = add_decode(self.shape, 1, r.num_computed_tokens)
        if bound_s is not None and self.model.step_s(cand) > bound_s:
            return False
        if not self.budget.take(r, 1):
            return False
        self.shape = cand
        self.chunk_left -= 1
        self.decode.append(r.req_id)
        return True

    def add_tokens(self, n: int) -> None:
        """`n` tokens through the token-wise layers only: piggybacked CPU-attention decodes
        (OmniServe §3.3.6) add GEMM rows but no GPU attention context."""
        self.shape = add_decode(self.shape, n, 0)
        self.chunk_left -= n

    def add_prefill(self, r: ReqState, bound_s: float | None = None, cap: int | None = None) -> int:
        """Prefill the longest chunk of `r` that fits the chunk, blocks and `bound_s`."""
        left = r.num_prefill_left
        limit = min(left, self.chunk_left if cap is None else min(cap, self.chunk_left))
        free_tok = self.budget.free * self.budget.block_size + (
            r.num_blocks * self.budget.block_size - r.num_computed_tokens
        )
        limit = min(limit, free_tok)
        if limit <= 0:
            return 0
        if bound_s is None:
            n = limit
        else:
            n = _max_chunk(self.model, self.shape, limit, r.num_computed_tokens, bound_s)
        if n <= 0 or not self.budget.take(r, n):
            return 0
        self.shape = add_prefill(self.shape, n, r.num_computed_tokens)
        self.chunk_left -= n
        self.prefill[r.req_id] = n
        return n


def plan_shape(inst: InstanceState, plan: StepPlan) -> BatchShape:
    """The batch `plan`'s first step runs on `inst` (its GPU prefill chunks and decodes)."""
    by_id = {r.req_id: r for r in inst.running}
    for r in inst.waiting:
        by_id.setdefault(r.req_id, r)
    shape = BatchShape()
    for rid, n in plan.prefill.items():
        got = by_id.get(rid)
        shape = add_prefill(shape, n, got.num_computed_tokens if got is not None else 0)
    ctx = sum(by_id[rid].num_computed_tokens for rid in plan.decode if rid in by_id)
    return add_decode(shape, len(plan.decode), ctx)


def _max_chunk(model: StepModel, shape: BatchShape, limit: int, cached: int, bound_s: float) -> int:
    """Largest chunk <= limit whose step stays within bound_s (OmniServe §3.3.4 search)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.step_s(add_prefill(shape, mid, cached)) <= bound_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def parse_section(params: Any, key: str) -> dict[str, Any]:
    """A nested mapping of a policy's params (e.g. the Tidal config's 'ooco' part)."""
    sub = params.get(key, {}) if params else {}
    if not isinstance(sub, dict):
        raise ValueError(f"params.{key} must be a mapping, got {type(sub).__name__}")
    return dict(sub)


def ids(reqs: Iterable[ReqState]) -> tuple[str, ...]:
    return tuple(r.req_id for r in reqs)


def make_room_for_decodes(
    inst: InstanceState, decodes: list[ReqState], decoding_first: bool = False
) -> list[ReqState]:
    """vLLM-style: when the next token of every decode does not fit in the free KV blocks, evict
    the newest running offline requests until it does (never an online one). Returns the victims.
    `decoding_first`: offline decodes go before offline prefills (a caller that can offload a
    decode keeps its KV, where an evicted prefill recomputes every chunk it had)."""
    bs = inst.block_size
    need = 0
    for r in decodes:
        if (r.num_computed_tokens + 1 + bs - 1) // bs > r.num_blocks:
            need += 1
    free = inst.num_free_blocks
    if need <= free:
        return []
    run = [r for r in inst.running if r.phase is Phase.RUNNING]
    # Offline only, newest first (the plan contract: online work is never evicted).
    pool = [r for r in reversed(run) if not r.is_online]
    if decoding_first:
        pool.sort(key=lambda r: (r.is_online, not r.is_decoding))  # stable: newest first within
    victims: list[ReqState] = []
    members = {id(r) for r in decodes}
    for v in pool:
        if need <= free or (len(pool) - len(victims) <= 1 and len(pool) == len(run)):
            break
        victims.append(v)
        free += v.num_blocks
        if id(v) in members and (v.num_computed_tokens + bs) // bs > v.num_blocks:
            need -= 1
    return victims


def stuck_online(inst: InstanceState) -> tuple[str, ...]:
    """The newest online request of the lowest priority when nothing on `inst` can move for
    lack of KV memory: no free block, no offline work holding any to evict, and every running
    request needs a new block for its next token. A policy never evicts online work (only a
    higher class does, `tidal.policy.class_preempt`, before the policy plans), so that request
    ends with an error (`StepPlan.abort_no_kv`) and the others go on with its blocks."""
    if inst.num_free_blocks > 0:
        return ()
    run = [r for r in inst.running if r.phase is Phase.RUNNING]
    if not run or any(not r.is_online and r.num_blocks for r in run):
        return ()
    bs = inst.block_size
    for r in run:
        if r.num_blocks * bs > r.num_computed_tokens:  # room in its last block: it can move
            return ()
    lowest = min(r.priority for r in run)
    return (next(r for r in reversed(run) if r.priority == lowest).req_id,)
