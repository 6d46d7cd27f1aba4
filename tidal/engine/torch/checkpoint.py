"""Offline KV checkpointed to host memory while it decodes (ConServe), for the torch engine.

`checkpoint(req_id)` queues the copy of the request's *full* KV blocks not yet saved into a host
store of its own, bounded by `EngineConfig.checkpoint_host_bytes` (reserved when queued; on a
CPU engine the "host" is a second tensor, still a real copy). With
`EngineConfig.checkpoint_background` (the default) a worker thread copies them
(`tidal.engine.torch.ckpt_copier`; on CUDA on a side stream) while the next step computes: full
blocks never change, so this is safe, but a block must not be freed while its copy reads it, so
every path that frees a request's blocks settles its copies first. Without it, the copy runs
synchronously inside the call. `wait_checkpoints()` waits for every copy queued.

`release` frees the request's GPU blocks at once, with no copy: the tokens past the last
*completed* checkpoint are lost and prefilled again. The request waits swapped; `swap_in`
restores it, copying back only the completed checkpoint. The checkpoint stays valid while the
request lives (its tokens never change), so a request released twice copies nothing twice; it
goes when the request ends, is recomputed or migrates.

Counted for `tidal bench checkpoint`: `num_checkpoint_bytes` (host bytes held or reserved now),
`num_checkpoint_lost_tokens` (tokens released past a checkpoint, recomputed later),
`num_checkpoint_cancelled_tokens` (queued copies dropped by a release before they ran),
`num_restored_tokens`, `num_checkpoint_releases` (releases by the engine's own eviction),
`last_release_s` (preemption to blocks freed, wall time).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from tidal.engine.api import RequestClass
from tidal.engine.torch import kv_transfer as kvt
from tidal.engine.torch.ckpt_copier import CheckpointCopier, CopyJob, JobState
from tidal.engine.torch.engine_config import EngineConfig
from tidal.engine.torch.kv_cache import BlockAllocator
from tidal.engine.torch.sequence import SeqStatus, Sequence
from tidal.plan import PlanRefused, RefusalReason

__all__ = ["JOB_BLOCKS", "TorchCheckpointMixin"]

JOB_BLOCKS = 8  # most blocks one copy job holds: what a release may wait for (see `release`)


class TorchCheckpointMixin:
    """`checkpoint` / `release` / `_restore`, the copier and the host store's accounting."""

    config: EngineConfig
    seqs: dict[str, Sequence]
    allocator: BlockAllocator
    block_size: int
    kv: torch.Tensor
    kv_bytes_per_token: float
    exporting: dict[str, Sequence]  # requests leaving (`migrate`): their checkpoint goes at the end

    if TYPE_CHECKING:

        def _kv_tokens(self, seq: Sequence) -> int: ...

        def _release_blocks(self, seq: Sequence) -> None: ...

        def _register_blocks(self, seq: Sequence) -> None: ...

        def _preempt_recompute(self, seq: Sequence) -> None: ...

    def _init_checkpoints(self) -> None:
        self.num_checkpoint_bytes = 0  # host bytes all checkpoints hold or have reserved now
        self.num_checkpoint_lost_tokens = 0  # tokens past a checkpoint that releases dropped
        self.num_checkpoint_cancelled_tokens = 0  # queued copies a release dropped unstarted
        self.num_checkpoint_copied_tokens = 0  # tokens whose copy to host completed, in all
        self.num_restored_tokens = 0  # tokens copied back from checkpoints by swap_in
        self.num_checkpoint_releases = 0  # checkpointed requests the own eviction released
        self.num_own_evictions = 0  # requests the own eviction took blocks from (either way)
        self.own_evict_s = 0.0  # the time those took, call to blocks free, in all
        self.last_release_s: float | None = None  # last release: call to blocks freed, seconds
        self.ckpt_copier = CheckpointCopier(self.kv)

    @property
    def checkpoint_capacity_bytes(self) -> int:
        """Host memory for checkpoints in all, bytes (0: none)."""
        return self.config.checkpoint_host_bytes

    @property
    def checkpoint_room_bytes(self) -> int:
        """Host bytes the checkpoint budget still has."""
        return self.config.checkpoint_host_bytes - self.num_checkpoint_bytes

    def checkpoint(self, req_id: str) -> None:
        """Queue the copy of the running offline request's full KV blocks not yet saved (or
        queued) to host memory. `PlanRefused(HOST_MEMORY_FULL)` when they do not fit the
        budget (nothing queued)."""
        seq = self._offline_running(req_id, "checkpoint")
        self._take_done(seq)
        full = seq.num_computed // self.block_size * self.block_size
        new = full - seq.num_ckpt_queued
        if new <= 0:
            return
        nbytes = int(new * self.kv_bytes_per_token)
        if nbytes > self.checkpoint_room_bytes:
            raise PlanRefused(
                RefusalReason.HOST_MEMORY_FULL,
                f"checkpoint of {req_id}: {nbytes} B more, {self.num_checkpoint_bytes} B of "
                f"{self.config.checkpoint_host_bytes} B held",
            )
        self._queue_checkpoint(seq, full)

    def wait_checkpoints(self) -> None:
        """Wait for every queued checkpoint copy to complete, and take them (the synchronous
        point tests and benchmarks use)."""
        self.ckpt_copier.wait([j for s in self.seqs.values() for j in s.ckpt_jobs])
        self._harvest_checkpoints()

    def release(self, req_id: str) -> None:
        """Free a checkpointed request's GPU blocks now (no copy); it waits swapped with its
        completed checkpoint as its KV, the tokens past it prefilled again after `swap_in`.

        Copies of it still queued: the one under way is waited for, those not started are
        cancelled and their tokens counted lost. Why: the copier is reading the running one's
        blocks, so they cannot be freed before it ends anyway, and a job holds at most
        `JOB_BLOCKS` blocks, so the wait is bounded by one short copy; waiting for all of them
        would make the preemption as slow as the copier's backlog (the first checkpoint after
        a long prefill is the whole prompt), which is what a release must not be. (Should
        nothing of it be copied yet, it waits swapped with an empty checkpoint: all its tokens
        are recomputed, as after `recompute`.) ValueError (nothing changed) when nothing of it
        is checkpointed or queued."""
        seq = self._offline_running(req_id, "release")
        if not seq.num_ckpt_queued:
            raise ValueError(f"{req_id!r} holds no checkpoint: recompute or swap it out instead")
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        self._settle_checkpoint(seq)
        kept = seq.num_ckpt_tokens
        self.num_checkpoint_lost_tokens += self._kv_tokens(seq) - kept
        self._release_blocks(seq)
        seq.partial = None  # a layer-cut chunk is past the checkpoint: recomputed
        seq.num_computed = kept
        del seq.hashes[kept // self.block_size :]
        seq.status = SeqStatus.SWAPPED
        self.last_release_s = time.perf_counter() - t0

    def _restore(self, seq: Sequence) -> None:
        """`swap_in` of a released request: blocks for its checkpoint, the checkpoint copied
        back chunk by chunk; MemoryError (nothing changed) when the blocks are not free."""
        n = seq.num_ckpt_tokens
        need = -(-n // self.block_size)
        if not self.allocator.can_allocate(need):
            raise MemoryError(
                f"{seq.req_id!r} needs {need} KV blocks, {self.allocator.num_free} free"
            )
        seq.block_ids = self.allocator.allocate(need)
        start = 0
        for host in seq.ckpt:
            end = start + host.shape[2]
            kvt.scatter_kv(
                self.kv, kvt.token_slots(seq.block_ids, start, end, self.block_size), host
            )
            start = end
        assert start == n == seq.num_computed, f"{seq.req_id}: checkpoint of {start}, not {n}"
        self.num_restored_tokens += n
        seq.status = SeqStatus.RUNNING
        seq.num_registered = 0
        self._register_blocks(seq)

    # ---- the engine's own planner (a step with no plan) -------------------------------------
    def _evict_offline(self, seq: Sequence) -> None:
        """Take an offline request's blocks for others: released to its checkpoint when it holds
        one (its blocks free at once, only the tail past it recomputed), else recomputed."""
        t0 = time.perf_counter()
        self._settle_checkpoint(seq)  # its copy under way is kept, the rest cancelled
        if seq.status == SeqStatus.RUNNING and seq.num_ckpt_tokens:
            self._release(seq)
            self.num_checkpoint_releases += 1
        else:
            self._preempt_recompute(seq)
        self.num_own_evictions += 1
        self.own_evict_s += time.perf_counter() - t0

    def _own_checkpoints(self) -> None:
        """Queue the copy of every running offline request's full blocks not yet saved, the
        latest arrival first (the own eviction takes those first), as many whole blocks as the
        budget has room for: past it, copying stops."""
        if not self.config.checkpoint_host_bytes:
            return
        bs = self.block_size
        block_bytes = int(bs * self.kv_bytes_per_token)
        for seq in reversed(self.seqs.values()):
            if seq.status != SeqStatus.RUNNING or seq.req.req_class is RequestClass.ONLINE:
                continue
            fit = self.checkpoint_room_bytes // block_bytes * bs
            end = min(seq.num_computed // bs * bs, seq.num_ckpt_queued + fit)
            if end > seq.num_ckpt_queued:
                self._queue_checkpoint(seq, end)

    def _resume_released(self) -> None:
        """Restore released requests (arrival order) while no online request is still to
        prefill (it comes first: its blocks are not handed back to offline work under it) and
        each fits with a block of room for every running request to grow (so that it is not
        released again at once); with nothing running, when it fits at all."""
        if any(
            s.req.req_class is RequestClass.ONLINE and not s.is_decode for s in self.seqs.values()
        ):
            return
        for seq in list(self.seqs.values()):
            if seq.status != SeqStatus.SWAPPED or seq.swapped_kv is not None:
                continue
            need = -(-seq.num_ckpt_tokens // self.block_size)
            running = sum(s.status == SeqStatus.RUNNING for s in self.seqs.values())
            if need + (running + 1 if running else 0) > self.allocator.num_free:
                return
            self._restore(seq)

    # ---- the copies ------------------------------------------------------------------------
    def _queue_checkpoint(self, seq: Sequence, end: int) -> None:
        """Copies of tokens [num_ckpt_queued, end) (whole blocks), `JOB_BLOCKS` a job, their
        bytes reserved now; done at once without `checkpoint_background`."""
        bs, step = self.block_size, JOB_BLOCKS * self.block_size
        while seq.num_ckpt_queued < end:
            start = seq.num_ckpt_queued
            stop = min(end, start + step)
            slots = kvt.token_slots(seq.block_ids, start, stop, bs)
            job = CopyJob(start, stop, slots, int((stop - start) * self.kv_bytes_per_token))
            self.num_checkpoint_bytes += job.nbytes
            seq.num_ckpt_queued = stop
            seq.ckpt_jobs.append(job)
            if self.config.checkpoint_background:
                self.ckpt_copier.submit(job)
            else:
                self.ckpt_copier.copy_now(job)
        self._take_done(seq)

    def _harvest_checkpoints(self) -> None:
        """Take every completed copy into its request's checkpoint (the engine's thread)."""
        for seq in self.seqs.values():
            if seq.ckpt_jobs:
                self._take_done(seq)

    def _take_done(self, seq: Sequence) -> None:
        while seq.ckpt_jobs and seq.ckpt_jobs[0].state is JobState.DONE:
            job = seq.ckpt_jobs.pop(0)
            if job.error is not None or job.result is None:
                raise RuntimeError(f"checkpoint copy of {seq.req_id} failed") from job.error
            assert job.start == seq.num_ckpt_tokens, f"{seq.req_id}: copies out of order"
            seq.ckpt.append(job.result)
            seq.num_ckpt_tokens = job.end
            self.num_checkpoint_copied_tokens += job.num_tokens

    def _settle_checkpoint(self, seq: Sequence) -> None:
        """Before `seq`'s blocks are freed: its copy under way finishes (and is kept), the
        ones not started are cancelled and their reserved bytes returned."""
        if not seq.ckpt_jobs:
            return
        self.ckpt_copier.settle(seq.ckpt_jobs)
        self._take_done(seq)
        for job in seq.ckpt_jobs:
            assert job.state is JobState.CANCELLED, f"{seq.req_id}: a copy outlived settle"
            self.num_checkpoint_bytes -= job.nbytes
            self.num_checkpoint_cancelled_tokens += job.num_tokens
        seq.ckpt_jobs = []
        seq.num_ckpt_queued = seq.num_ckpt_tokens

    def _drop_checkpoint(self, seq: Sequence) -> None:
        self._settle_checkpoint(seq)
        self.num_checkpoint_bytes -= int(seq.num_ckpt_tokens * self.kv_bytes_per_token)
        seq.ckpt = []
        seq.num_ckpt_tokens = seq.num_ckpt_queued = 0

    def _check_checkpoints(self) -> None:
        """`check_integrity`'s part: every request's checkpoint and the budget's bytes."""
        for s in self.seqs.values():
            if s.status == SeqStatus.SWAPPED and s.swapped_kv is None:  # released
                assert s.num_ckpt_tokens == self._kv_tokens(s), f"{s.req_id}: released past it"
                assert not s.ckpt_jobs, f"{s.req_id}: released with copies queued"
            assert sum(c.shape[2] for c in s.ckpt) == s.num_ckpt_tokens
            queued = sum(j.num_tokens for j in s.ckpt_jobs)
            assert s.num_ckpt_tokens + queued == s.num_ckpt_queued <= s.num_computed, (
                f"{s.req_id}: checkpoint {s.num_ckpt_tokens} + {queued} queued"
            )
        owners = [*self.seqs.values(), *self.exporting.values()]  # one leaving keeps its own
        held = sum(int(s.num_ckpt_queued * self.kv_bytes_per_token) for s in owners)
        assert held == self.num_checkpoint_bytes <= self.config.checkpoint_host_bytes

    def _offline_running(self, req_id: str, what: str) -> Sequence:
        seq = self.seqs[req_id]
        if seq.req.req_class is RequestClass.ONLINE:
            raise ValueError(f"{req_id!r} is online: only offline work is checkpointed")
        if seq.status != SeqStatus.RUNNING:
            raise ValueError(f"{req_id!r} is {seq.status}; only a running request can {what}")
        return seq
