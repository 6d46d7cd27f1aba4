"""Offline KV checkpoints (ConServe) in the `sim` engine, as the torch engine keeps them
(`tidal.engine.torch.checkpoint`), emulated: with `SimEngineConfig.checkpoint_host_bytes` > 0,
`checkpoint` marks a running offline request's full blocks as saved to host memory (the budget
counts `kv_bytes_per_token` a token; the copy is taken to run beside the step and costs no
emulated time), `release` frees its blocks at once and leaves it swapped with the checkpoint as
its KV (the tokens past it are lost and prefilled again), and `swap_in` restores it.

The own planner (a step with no plan) checkpoints every running offline request, the latest
arrival first, as far as the budget goes; its eviction releases a checkpointed victim instead
of recomputing it, and released requests are restored when the KV has room for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.engine.api import RequestClass
from tidal.engine.sim.config import SimEngineConfig
from tidal.engine.sim.seq import RUNNING, SWAPPED, SimSeq
from tidal.plan import PlanRefused, RefusalReason

__all__ = ["SimCheckpointMixin"]


class SimCheckpointMixin:
    config: SimEngineConfig
    seqs: dict[str, SimSeq]
    block_size: int
    kv_bytes_per_token: float
    num_recompute_preemptions: int
    _free_blocks: int

    if TYPE_CHECKING:

        def _release(self, seq: SimSeq, keep_partial: bool = False) -> None: ...

        def swap_in(self, req_id: str) -> None: ...

    def _init_checkpoints(self) -> None:
        self.num_checkpoint_lost_tokens = 0  # tokens past a checkpoint that releases dropped
        self.num_restored_tokens = 0  # tokens swap_in brought back from checkpoints
        self.num_checkpoint_releases = 0  # checkpointed requests the own eviction released
        self.num_checkpoint_copied_tokens = 0  # tokens checkpointed, in all
        self.num_recompute_lost_tokens = 0  # KV tokens the own eviction's recomputes dropped

    @property
    def checkpoint_capacity_bytes(self) -> int:
        return self.config.checkpoint_host_bytes

    @property
    def num_checkpoint_bytes(self) -> int:
        """Host bytes the live requests' checkpoints hold (a request that leaves frees its)."""
        tokens = sum(s.num_ckpt_tokens for s in self.seqs.values())
        return int(tokens * self.kv_bytes_per_token)

    @property
    def checkpoint_room_bytes(self) -> int:
        return self.config.checkpoint_host_bytes - self.num_checkpoint_bytes

    def checkpoint(self, req_id: str) -> None:
        """The running offline request's full blocks not yet saved, saved;
        `PlanRefused(HOST_MEMORY_FULL)` (nothing changed) past the budget."""
        seq = self._offline_running(req_id, "checkpoint")
        full = seq.num_computed // self.block_size * self.block_size
        new = full - seq.num_ckpt_tokens
        if new <= 0:
            return
        if new * self.kv_bytes_per_token > self.checkpoint_room_bytes:
            raise PlanRefused(
                RefusalReason.HOST_MEMORY_FULL,
                f"checkpoint of {req_id}: {new} tokens more, {self.num_checkpoint_bytes} B of "
                f"{self.config.checkpoint_host_bytes} B held",
            )
        seq.num_ckpt_tokens = full
        self.num_checkpoint_copied_tokens += new

    def release(self, req_id: str) -> None:
        """Free a checkpointed request's blocks now; it waits swapped with its checkpoint."""
        seq = self._offline_running(req_id, "release")
        if not seq.num_ckpt_tokens:
            raise ValueError(f"{req_id!r} holds no checkpoint: recompute or swap it out instead")
        self.num_checkpoint_lost_tokens += seq.num_kv_tokens - seq.num_ckpt_tokens
        self._release(seq)  # the blocks, and a layer-cut chunk (past the checkpoint)
        seq.num_computed = seq.num_host_tokens = seq.num_ckpt_tokens
        seq.status, seq.is_released = SWAPPED, True

    def _restored(self, seq: SimSeq) -> None:
        """`swap_in` placed a released request's checkpoint back."""
        if seq.is_released:
            self.num_restored_tokens += seq.num_computed
            seq.is_released = False

    def _drop_checkpoint(self, seq: SimSeq) -> None:
        seq.num_ckpt_tokens = 0

    # ---- the own planner -------------------------------------------------------------------
    def _evict_offline(self, seq: SimSeq) -> None:
        """The own eviction: released to its checkpoint when it holds one, else recomputed."""
        if seq.status == RUNNING and seq.num_ckpt_tokens:
            self.release(seq.req_id)
            self.num_checkpoint_releases += 1
            return
        self._release(seq)
        self.num_recompute_lost_tokens += seq.num_computed
        seq.num_computed = seq.num_ckpt_tokens = 0
        self.num_recompute_preemptions += 1

    def _own_checkpoints(self) -> None:
        """Every running offline request's full blocks, latest arrival first (the own eviction
        takes those first), as many whole blocks as the budget has room for."""
        if not self.config.checkpoint_host_bytes:
            return
        bs = self.block_size
        for seq in sorted(self.seqs.values(), key=lambda s: -s.req.arrival_s):
            if seq.status != RUNNING or seq.req.req_class is RequestClass.ONLINE:
                continue
            fit = int(self.checkpoint_room_bytes // (bs * self.kv_bytes_per_token)) * bs
            end = min(seq.num_computed // bs * bs, seq.num_ckpt_tokens + fit)
            if end > seq.num_ckpt_tokens:
                self.num_checkpoint_copied_tokens += end - seq.num_ckpt_tokens
                seq.num_ckpt_tokens = end

    def _resume_released(self) -> None:
        """Restore released requests (arrival order) while no online request is still to
        prefill and each fits with a block of room for every running request (with none
        running: if it fits)."""
        seqs = sorted(self.seqs.values(), key=lambda s: s.req.arrival_s)
        if any(s.req.req_class is RequestClass.ONLINE and not s.is_decode for s in seqs):
            return
        for seq in seqs:
            if seq.status != SWAPPED or not seq.is_released:
                continue
            need = -(-seq.num_host_tokens // self.block_size)
            running = sum(s.status == RUNNING for s in seqs)
            if need + (running + 1 if running else 0) > self._free_blocks:
                return
            self.swap_in(seq.req_id)

    def _check_checkpoints(self) -> None:
        for s in self.seqs.values():
            assert s.num_ckpt_tokens <= s.num_computed, f"{s.req_id}: checkpoint past its KV"
            assert s.num_ckpt_tokens % self.block_size == 0, f"{s.req_id}: a partial block"
            if s.is_released:
                assert s.status == SWAPPED and s.num_host_tokens == s.num_ckpt_tokens
        assert self.num_checkpoint_bytes <= self.config.checkpoint_host_bytes

    def _offline_running(self, req_id: str, what: str) -> SimSeq:
        seq = self.seqs[req_id]
        if seq.req.req_class is RequestClass.ONLINE:
            raise ValueError(f"{req_id!r} is online: only offline work is checkpointed")
        if seq.status != RUNNING:
            raise ValueError(f"{req_id!r} is {seq.status}; only a running request can {what}")
        return seq
