"""An engine's own step planner: the FCFS chunked-prefill default, used when no policy plans.

A plan (`tidal.plan.StepPlan`, the one plan type) says how many tokens each request
computes this step; one step mixes prefill chunks and decodes (continuous batching). Under a
policy the instance service hands the engine the policy's plan instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tidal.engine.api import SnapshotSource
from tidal.plan import StepPlan
from tidal.schemas.enums import RequestClass


@dataclass(frozen=True)
class SeqView:
    """What a planner may see of one schedulable request (swapped-out ones are not shown)."""

    req_id: str
    req_class: RequestClass
    arrival_s: float
    num_pending: int  # tokens whose KV is not yet computed (1 for a decode)
    is_decode: bool  # prompt done, one token to compute
    has_kv: bool  # holds KV blocks now (running), False while waiting
    forced_tokens: int  # > 0: a preempted partial chunk that must be resumed with exactly this
    num_blocks: int = 0  # KV blocks it holds now (an offline holder's may be taken for online)

    @classmethod
    def of(cls, seq: SnapshotSource) -> SeqView:
        """The planner's view of one engine's request record (both engines' own planners)."""
        return cls(
            req_id=seq.req.req_id,
            req_class=seq.req.req_class,
            arrival_s=seq.req.arrival_s,
            num_pending=seq.num_pending,
            is_decode=seq.is_decode,
            has_kv=seq.num_device_blocks > 0,
            forced_tokens=seq.forced_tokens,
            num_blocks=seq.num_device_blocks,
        )


class StepPlanner(Protocol):
    def plan(self, seqs: Sequence[SeqView], num_free_blocks: int, block_size: int) -> StepPlan: ...


@dataclass(frozen=True)
class FcfsChunkedPlanner:
    """All decodes first, then prefill chunks, online ones first and each class in arrival
    order, until the token budget is spent. An online prefill may count the blocks offline
    requests hold: the engine takes them back (recompute) to make room; an online request's
    are never counted for anyone."""

    token_budget: int = 512  # tokens computed per step, decodes included
    chunk_size: int = 512  # most prefill tokens one request gets per step
    max_num_seqs: int = 256  # most requests in one step

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.chunk_size < 1 or self.max_num_seqs < 1:
            raise ValueError("token_budget, chunk_size and max_num_seqs must be >= 1")

    def plan(self, seqs: Sequence[SeqView], num_free_blocks: int, block_size: int) -> StepPlan:
        order = sorted(seqs, key=lambda s: s.arrival_s)
        by_id = {s.req_id: s for s in seqs}
        out: dict[str, int] = {}
        budget = self.token_budget
        # Resumed partial chunks first: their KV for early layers is already written.
        for s in order:
            # (over budget only when alone, so a budget cut after the preemption cannot starve it)
            fits = s.forced_tokens <= budget or not out
            if s.forced_tokens and fits and len(out) < self.max_num_seqs:
                out[s.req_id] = s.forced_tokens
                budget -= s.forced_tokens
        for s in order:
            if s.is_decode and s.req_id not in out and budget > 0 and len(out) < self.max_num_seqs:
                out[s.req_id] = 1
                budget -= 1
        # Blocks new prefills may take: a rough guard, the engine re-checks exactly.
        blocks = num_free_blocks
        offline_held = sum(s.num_blocks for s in seqs if s.req_class is not RequestClass.ONLINE)
        order.sort(key=lambda s: s.req_class is not RequestClass.ONLINE)  # stable: by arrival
        for s in order:
            if s.req_id in out or s.is_decode or s.forced_tokens or budget <= 0:
                continue
            if len(out) >= self.max_num_seqs:
                break
            n = min(s.num_pending, self.chunk_size, budget)
            need = -(-n // block_size)
            online = s.req_class is RequestClass.ONLINE
            if not s.has_kv and need > blocks + (offline_held if online else 0):
                break  # FCFS: do not let later requests overtake a waiting one
            if online and need > blocks:  # the rest from offline holders
                offline_held -= need - max(blocks, 0)
                blocks = min(blocks, 0)
            else:
                blocks -= need
            out[s.req_id] = n
            budget -= n
        decode = tuple(rid for rid, n in out.items() if n == 1 and by_id[rid].is_decode)
        prefill = {rid: n for rid, n in out.items() if rid not in decode}
        return StepPlan(prefill=prefill, decode=decode)
