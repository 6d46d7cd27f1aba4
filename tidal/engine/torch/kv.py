"""The torch engine's KV admission under memory pressure, by class (the contract:
`tidal.plan.step`, docs/plan-contract.md): when blocks run out, offline requests give theirs
back, latest arrival first: released to their KV checkpoint when they hold one
(`tidal.engine.torch.checkpoint`), else by recompute; an online request is never evicted. It
waits for room, and when nothing in a step can run and only online requests hold KV, the newest
of them ends with an "out of KV memory" error event (`api.OUT_OF_KV_ERROR`), never a silent
"length"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.engine.api import RequestClass
from tidal.engine.torch.kv_cache import BlockAllocator, block_hashes
from tidal.engine.torch.sequence import SeqStatus, Sequence
from tidal.plan import StepPlan

__all__ = ["TorchKvMixin"]


class TorchKvMixin:
    """`_prepare` (a step's plan -> the items to run, KV allocated) and what it needs."""

    seqs: dict[str, Sequence]
    allocator: BlockAllocator
    block_size: int
    num_recompute_preemptions: int
    num_recompute_lost_tokens: int

    def _free(self, seq: Sequence) -> None:
        raise NotImplementedError

    if TYPE_CHECKING:

        def _drop_checkpoint(self, seq: Sequence) -> None: ...

        def _settle_checkpoint(self, seq: Sequence) -> None: ...

        def _evict_offline(self, seq: Sequence) -> None: ...

    def _prepare(self, plan: StepPlan) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Check the plan, admit and allocate KV. When blocks run out, offline requests give
        theirs back (released to a checkpoint, else recompute), latest arrival first; an
        online request is never evicted: it waits for room, and when nothing in the step can
        run and only online requests hold KV, the newest of them ends for lack of KV memory.
        Returns (items to run, requests ended out of KV memory, already removed)."""
        items: list[tuple[Sequence, int]] = []
        ended: list[Sequence] = []
        if plan.offload or plan.recall:
            raise ValueError("offload/recall are the executor's to carry out, before the step")
        # Cut chunks first, then decodes, then prefill chunks: the order the runner batches
        # rows in, which a chunk cut at a layer boundary resumes with.
        merged = dict(plan.prefill) | dict.fromkeys(plan.decode, 1)
        decodes = set(plan.decode)

        def rank(rid: str) -> int:
            seq = self.seqs.get(rid)
            return 0 if seq is not None and seq.partial is not None else 1 + (rid not in decodes)

        num_tokens = {rid: merged[rid] for rid in sorted(merged, key=rank)}
        for rid, n in num_tokens.items():
            seq = self.seqs.get(rid)
            if seq is None or seq.status == SeqStatus.SWAPPED:
                raise ValueError(f"plan schedules {rid!r}, which is unknown or swapped out")
            if n < 1:
                raise ValueError(f"plan gives {rid!r} {n} tokens; every entry needs >= 1")
            if seq.partial is not None and n != seq.partial.num_tokens:
                raise ValueError(
                    f"{rid!r} must resume its preempted chunk of {seq.partial.num_tokens}"
                )
        stuck = [(self.seqs[rid], n) for rid, n in num_tokens.items()]
        while stuck:
            stuck = [(s, n) for s, n in stuck if not self._allocate(s, n, items)]
            online = any(s.req.req_class is RequestClass.ONLINE for s, _ in stuck)
            if not stuck or items or not online:
                break  # the stuck ones wait for room (an online one keeps its blocks)
            victim = self._newest_online_holder()
            if victim is None:
                break  # they hold no KV: they wait
            self.seqs.pop(victim.req_id)
            self._free(victim)
            ended.append(victim)
            stuck = [(s, n) for s, n in stuck if s is not victim]
        return items, ended

    def _allocate(self, seq: Sequence, n: int, items: list[tuple[Sequence, int]]) -> bool:
        """Give `seq` the blocks for `n` more tokens and add it to `items`, taking them from
        offline requests if need be: for an online request from any (latest arrival first),
        for an offline one from later arrivals, then from itself (released to its checkpoint
        when it holds one, else recomputed). False: it waits."""
        if seq.status == SeqStatus.SWAPPED:
            return False  # released this step to make room for another
        if not seq.block_ids:
            self._admit(seq)
        n = min(n, seq.num_pending)
        need = -(-(seq.num_computed + n) // self.block_size) - len(seq.block_ids)
        online = seq.req.req_class is RequestClass.ONLINE
        while not self.allocator.can_allocate(need):
            victim = next(
                (
                    s
                    for s in reversed(self.seqs.values())
                    if s.block_ids
                    and s.req.req_class is not RequestClass.ONLINE
                    and (online or s.req.arrival_s >= seq.req.arrival_s)
                ),
                None,
            )
            if victim is None or victim is seq:
                if not online and seq.block_ids:
                    self._evict_offline(seq)  # an offline request makes room for others
                elif not seq.block_ids:
                    seq.status = SeqStatus.WAITING
                return False
            self._evict_offline(victim)
            items[:] = [(s, k) for s, k in items if s is not victim]
        seq.block_ids += self.allocator.allocate(need)
        items.append((seq, n))
        return True

    def _newest_online_holder(self) -> Sequence | None:
        return next(
            (
                s
                for s in reversed(self.seqs.values())
                if s.block_ids and s.req.req_class is RequestClass.ONLINE
            ),
            None,
        )

    def _admit(self, seq: Sequence) -> None:
        """First schedule of a request with no KV: take what the prefix cache holds."""
        # keep at least the last token to compute: its logits give the next token
        hashes = block_hashes(seq.token_ids[: len(seq.token_ids) - 1], self.block_size)
        hit = self.allocator.lookup(hashes)
        seq.block_ids = hit
        seq.hashes = hashes[: len(hit)]
        seq.num_registered = len(hit)
        seq.num_computed = len(hit) * self.block_size
        seq.num_cached_tokens = min(seq.num_computed, seq.num_prompt)
        seq.status = SeqStatus.RUNNING

    def _preempt_recompute(self, seq: Sequence) -> None:
        self.num_recompute_preemptions += 1
        self.num_recompute_lost_tokens += seq.num_computed
        self._release_blocks(seq)
        self._drop_checkpoint(seq)
        seq.num_computed = 0
        seq.partial = None
        seq.hashes = []
        seq.status = SeqStatus.WAITING

    def _release_blocks(self, seq: Sequence) -> None:
        self._settle_checkpoint(seq)  # no block is freed while a checkpoint copy reads it
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_registered = 0
