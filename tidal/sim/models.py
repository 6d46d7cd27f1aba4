"""Small latency models for tests and for the CPU-attention workers."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.perf.api import BatchShape


@dataclass(frozen=True, slots=True)
class LinearStepModel:
    """step_s = base + per_token * tokens + per_pair * prefill attention pairs
    + per_ctx * decode context tokens. Hand-checkable; for tests and quick what-ifs."""

    base_s: float = 0.01
    per_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_ctx_s: float = 0.0

    def step_s(self, batch: BatchShape) -> float:
        return (
            self.base_s
            + self.per_token_s * batch.num_tokens
            + self.per_pair_s * batch.prefill_attn_pairs
            + self.per_ctx_s * batch.decode_context_tokens
        )


@dataclass(frozen=True, slots=True)
class CpuAttnRoofline:
    """Decode attention on CPU workers is memory bound (OmniServe §3.2): it streams each
    request's KV once per step. time = overhead + KV bytes / (workers * bytes/s per worker)."""

    kv_bytes_per_token: float  # all layers, K and V
    bytes_per_s_per_worker: float = 100e9  # sustained host memory bandwidth of one worker
    overhead_s: float = 0.002  # per step: queueing, the residual store, PCIe round trip

    def attn_s(self, num_reqs: int, context_tokens: int, num_workers: int) -> float:
        if num_reqs == 0:
            return 0.0
        bw = max(num_workers, 1) * self.bytes_per_s_per_worker
        return self.overhead_s + context_tokens * self.kv_bytes_per_token / bw
