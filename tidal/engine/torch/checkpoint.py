"""Offline KV checkpointed to host memory while it decodes (ConServe), for the torch engine.

`checkpoint(req_id)` copies the request's *full* KV blocks not yet saved into a host store of
its own (one host tensor per call, `(L, 2, T, Hk, D)`; on a CPU engine the "host" is a second
tensor pool, still a real copy), bounded by `EngineConfig.checkpoint_host_bytes`. `release`
then frees the request's GPU blocks at once, with no copy: the tokens past the last
checkpointed block (under one block when it was checkpointed every step) are lost and prefilled
again. The request waits swapped; `swap_in` restores it, copying back only the checkpoint.
The checkpoint stays valid while the request lives (its tokens never change), so a request
released twice copies nothing twice; it goes when the request ends, is recomputed or migrates.

Counted for `tidal bench checkpoint`: `num_checkpoint_bytes` (host bytes held now),
`num_checkpoint_lost_tokens` (tokens released past a checkpoint, recomputed later),
`num_restored_tokens`, `last_release_s` (preemption to blocks freed, wall time).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from tidal.engine.api import RequestClass
from tidal.engine.torch import kv_transfer as kvt
from tidal.engine.torch.engine_config import EngineConfig
from tidal.engine.torch.kv_cache import BlockAllocator
from tidal.engine.torch.sequence import SeqStatus, Sequence
from tidal.plan import PlanRefused, RefusalReason

__all__ = ["TorchCheckpointMixin"]


class TorchCheckpointMixin:
    """`checkpoint` / `release` / `_restore` and their host store accounting."""

    config: EngineConfig
    seqs: dict[str, Sequence]
    allocator: BlockAllocator
    block_size: int
    kv: torch.Tensor
    kv_bytes_per_token: float

    if TYPE_CHECKING:

        def _kv_tokens(self, seq: Sequence) -> int: ...

        def _release_blocks(self, seq: Sequence) -> None: ...

        def _register_blocks(self, seq: Sequence) -> None: ...

    def _init_checkpoints(self) -> None:
        self.num_checkpoint_bytes = 0  # host bytes all checkpoints hold now
        self.num_checkpoint_lost_tokens = 0  # tokens past a checkpoint that releases dropped
        self.num_restored_tokens = 0  # tokens copied back from checkpoints by swap_in
        self.last_release_s: float | None = None  # last release: call to blocks freed, seconds

    @property
    def checkpoint_capacity_bytes(self) -> int:
        """Host memory for checkpoints in all, bytes (0: none)."""
        return self.config.checkpoint_host_bytes

    @property
    def checkpoint_room_bytes(self) -> int:
        """Host bytes the checkpoint budget still has."""
        return self.config.checkpoint_host_bytes - self.num_checkpoint_bytes

    def checkpoint(self, req_id: str) -> None:
        """Copy the running offline request's full KV blocks not yet saved to host memory.
        `PlanRefused(HOST_MEMORY_FULL)` when they do not fit the budget (nothing copied)."""
        seq = self._offline_running(req_id, "checkpoint")
        full = seq.num_computed // self.block_size * self.block_size
        new = full - seq.num_ckpt_tokens
        if new <= 0:
            return
        nbytes = int(new * self.kv_bytes_per_token)
        if nbytes > self.checkpoint_room_bytes:
            raise PlanRefused(
                RefusalReason.HOST_MEMORY_FULL,
                f"checkpoint of {req_id}: {nbytes} B more, {self.num_checkpoint_bytes} B of "
                f"{self.config.checkpoint_host_bytes} B held",
            )
        slots = kvt.token_slots(seq.block_ids, seq.num_ckpt_tokens, full, self.block_size)
        host = kvt.gather_kv(self.kv, slots)  # (L, 2, new, Hk, D), a copy off the pool
        if host.data_ptr() == self.kv.data_ptr():  # NOTE: never a view of the pool
            host = host.clone()
        seq.ckpt.append(host)
        seq.num_ckpt_tokens = full
        self.num_checkpoint_bytes += nbytes

    def release(self, req_id: str) -> None:
        """Free a checkpointed request's GPU blocks now (no copy); it waits swapped with its
        checkpoint as its KV, the tokens past it to be prefilled again after `swap_in`."""
        seq = self._offline_running(req_id, "release")
        if not seq.num_ckpt_tokens:
            raise ValueError(f"{req_id!r} holds no checkpoint: recompute or swap it out instead")
        t0 = time.perf_counter()
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

    def _drop_checkpoint(self, seq: Sequence) -> None:
        self.num_checkpoint_bytes -= int(seq.num_ckpt_tokens * self.kv_bytes_per_token)
        seq.ckpt = []
        seq.num_ckpt_tokens = 0

    def _offline_running(self, req_id: str, what: str) -> Sequence:
        seq = self.seqs[req_id]
        if seq.req.req_class is RequestClass.ONLINE:
            raise ValueError(f"{req_id!r} is online: only offline work is checkpointed")
        if seq.status != SeqStatus.RUNNING:
            raise ValueError(f"{req_id!r} is {seq.status}; only a running request can {what}")
        return seq
