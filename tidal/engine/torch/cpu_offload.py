"""The torch engine's CPU-attention operations (OmniServe §3.2): offload a decoding request's KV
to a worker, recall it, let the policy's admitted offloaded requests ride a step
(`tidal.engine.torch.piggyback`), and re-queue by recompute what a lost worker held.

A mixin of `TorchEngine`, kept apart so the engine file stays about one idea.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import torch

from tidal.engine.api import OffloadRefused
from tidal.engine.torch import kv_transfer as kvt
from tidal.engine.torch.piggyback import CpuAttnLink, Piggyback
from tidal.engine.torch.sequence import CpuProgress, SeqStatus, Sequence

log = logging.getLogger("tidal.engine")

ALONE_WAIT_S = 0.05  # a step of offloaded rows alone waits this long per layer for outputs


class CpuOffloadMixin:
    seqs: dict[str, Sequence]
    block_size: int
    kv: torch.Tensor
    max_model_len: int
    cpu_link: CpuAttnLink | None = None
    num_cpu_attn_lost = 0  # requests re-queued by recompute after their worker was lost
    # (offloaded rows, seconds of residual-store and queue work) of recent piggybacked steps
    piggy_steps: deque[tuple[int, float]]

    def attach_cpu_attn(self, link: CpuAttnLink | None) -> None:
        """Use these CPU-attention workers for `offload`/`recall`/`cpu_decode` (None: none)."""
        self.cpu_link = link
        self.piggy_steps = deque(maxlen=4096)

    def offload(self, req_id: str) -> None:
        """Move a decoding request's KV to a worker and free its blocks; it decodes on with its
        attention there. OffloadRefused (it stays here) when no worker takes it; ValueError when
        it is not a running decode at a token boundary."""
        seq = self.seqs[req_id]
        if self.cpu_link is None:
            raise OffloadRefused("this instance has no CPU-attention workers")
        if seq.status != SeqStatus.RUNNING or seq.partial is not None or not seq.is_decode:
            raise ValueError(f"{req_id!r} is not a running decode; only those are offloaded")
        n = seq.num_computed
        kv = kvt.gather_kv(self.kv, kvt.token_slots(seq.block_ids, 0, n, self.block_size))
        left = seq.req.sampling.max_tokens - seq.num_output + 1
        reserve = max(1, min(left, self.max_model_len - n))
        self.cpu_link.offload(req_id, kv, reserve)
        self._release_blocks(seq)
        seq.status = SeqStatus.OFFLOADED
        seq.cpu = CpuProgress()

    def recall(self, req_id: str) -> None:
        """Bring an offloaded request's KV back. OmniServe §3.2.4 recalls at a token boundary;
        here a request in the middle of a token comes back with its complete tokens and runs
        that token again on the instance (one token's dense work, and no waiting for the
        worker). MemoryError when it does not fit: it stays offloaded, as it was."""
        seq = self.seqs[req_id]
        if seq.status != SeqStatus.OFFLOADED or seq.cpu is None or self.cpu_link is None:
            raise ValueError(f"{req_id!r} is not offloaded")
        kv = self.cpu_link.recall(req_id)
        if kv.shape[2] != seq.num_computed:
            held, want = kv.shape[2], seq.num_computed
            raise ValueError(f"{req_id!r}: its worker holds {held} tokens, not {want}")
        self._place_kv(seq, kv)  # MemoryError leaves it offloaded, the worker's copy intact
        self.cpu_link.drop(req_id)  # with any output still on its way for the token in flight
        seq.cpu = None

    def _piggyback(
        self, req_ids: tuple[str, ...], alone: bool, should_stop: Callable[[], bool]
    ) -> Piggyback | None:
        """This step's offloaded rows: the policy's `cpu_decode` (ValueError for a request that
        is not offloaded)."""
        if not req_ids:
            return None
        seqs = []
        for rid in req_ids:
            seq = self.seqs.get(rid)
            if seq is None or seq.status != SeqStatus.OFFLOADED:
                raise ValueError(f"plan's cpu_decode names {rid!r}, which is not offloaded")
            seqs.append(seq)
        assert self.cpu_link is not None
        model = self.runner.model  # type: ignore[attr-defined]
        return Piggyback(
            seqs,
            self.cpu_link,
            model.embed_tokens,
            model.config.num_hidden_layers,
            model.device,
            wait_s=ALONE_WAIT_S if alone else 0.0,
            should_stop=should_stop,
        )

    def _requeue_lost(self) -> None:
        """Requests whose worker died (or failed them) prefill prompt + tokens so far again."""
        if self.cpu_link is None:
            return
        for rid in self.cpu_link.take_lost():
            seq = self.seqs.get(rid)
            if seq is None or seq.status != SeqStatus.OFFLOADED:
                continue
            log.warning("%s lost its CPU-attention worker; recomputing its context", rid)
            seq.cpu = None
            seq.num_computed = 0
            seq.hashes = []
            seq.status = SeqStatus.WAITING
            self.num_cpu_attn_lost += 1

    def _drop_offloaded(self, seq: Sequence) -> None:
        if seq.cpu is not None:
            if self.cpu_link is not None:
                self.cpu_link.drop(seq.req_id)
            seq.cpu = None

    # provided by TorchEngine
    def _release_blocks(self, seq: Sequence) -> None: ...
    def _place_kv(self, seq: Sequence, kv: torch.Tensor) -> None: ...
