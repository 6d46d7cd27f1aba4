"""A CPU-attention worker's host KV store and its decode attention (OmniServe §3.2.1, §4).

The worker holds the KV of many offloaded requests in host memory, each in one buffer laid out
(L, 2, Hk, capacity, D) so a layer's keys and values of a request are contiguous (Hk, T, D)
views: one decode token's attention is two batched matmuls per request over memory read once.
Capacity is counted in bytes: a request reserves room for its context plus the tokens it may
still generate when it arrives, so an append never fails later; past the configured bound an
offload is refused with the reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tidal.cpu_attn.batched import attend_rows


class StoreFull(Exception):
    """The worker has no room for this request (the reason says how much it lacks)."""


@dataclass
class _Entry:
    kv: torch.Tensor  # (L, 2, Hk, cap, D)
    lens: list[int]  # tokens written, per layer

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[3])

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class StoreStats:
    num_requests: int
    kv_tokens: int  # context tokens held (all layers written)
    used_bytes: int
    capacity_bytes: int
    num_offloads: int
    num_recalls: int
    num_refused: int


class KvStore:
    """Thread-safe; one instance per worker, shared by every instance connected to it."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.num_offloads = 0
        self.num_recalls = 0
        self.num_refused = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def put(self, req_id: str, kv: torch.Tensor, reserve_tokens: int) -> None:
        """Take a request's KV (L, 2, T, Hk, D); StoreFull past the capacity, ValueError for a
        request already held or a bad shape."""
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"KV must be (L, 2, T, Hk, D), got {list(kv.shape)}")
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        L, _, T, Hk, D = kv.shape
        cap = T + reserve_tokens
        need = L * 2 * Hk * cap * D * kv.element_size()
        with self._lock:
            if req_id in self._entries:
                raise ValueError(f"{req_id!r} is already offloaded to this worker")
            if need > self.free_bytes:
                self.num_refused += 1
                raise StoreFull(
                    f"needs {need / 2**20:.1f} MiB for {cap} tokens, "
                    f"{self.free_bytes / 2**20:.1f} MiB of {self.capacity_bytes / 2**20:.1f} free"
                )
            self.used_bytes += need
        buf = torch.empty((L, 2, Hk, cap, D), dtype=kv.dtype)
        buf[:, :, :, :T].copy_(kv.permute(0, 1, 3, 2, 4))
        with self._lock:
            self._entries[req_id] = _Entry(buf, [T] * L)
            self.num_offloads += 1

    def get(self, req_id: str) -> torch.Tensor:
        """The request's KV (L, 2, T, Hk, D) (a copy) of the tokens every layer holds: in the
        middle of a token, that token's first layers are left out (the instance computes the
        token again). KeyError if unknown."""
        with self._lock:
            e = self._entries[req_id]
            T = min(e.lens)
            out = e.kv[:, :, :, :T].permute(0, 1, 3, 2, 4).contiguous()
            self.num_recalls += 1
            return out

    def drop(self, req_id: str) -> bool:
        with self._lock:
            e = self._entries.pop(req_id, None)
            if e is None:
                return False
            self.used_bytes -= e.num_bytes
            return True

    def attend(
        self,
        layer: int,
        req_ids: list[str],
        positions: list[int],
        qkv: torch.Tensor,
        num_heads: int,
        scale: float,
    ) -> tuple[torch.Tensor, dict[str, str]]:
        """Append each row's k, v at `layer` and attend its q over the request's whole context.
        qkv (B, H + 2 Hk, D) -> (B, H * D) and {req_id: error} for rows not computed (unknown
        request, wrong position, reserve used up): those rows are zero."""
        B, _, D = qkv.shape
        H = num_heads
        Hk = (qkv.shape[1] - H) // 2
        if len(req_ids) != B or len(positions) != B or H <= 0 or Hk <= 0 or H % Hk:
            raise ValueError("attention rows, ids and positions do not match")
        out = torch.zeros((B, H * D), dtype=qkv.dtype)
        errors: dict[str, str] = {}
        with self._lock:
            entries = [self._entries.get(rid) for rid in req_ids]
        rows: list[int] = []
        kvs: list[torch.Tensor] = []
        lens: list[int] = []
        for i, (rid, pos, e) in enumerate(zip(req_ids, positions, entries, strict=True)):
            if e is None:
                errors[rid] = "not offloaded to this worker"
                continue
            if not 0 <= layer < len(e.lens) or e.kv.shape[2] != Hk or e.kv.shape[4] != D:
                errors[rid] = f"layer {layer} or head shape does not match the offloaded KV"
                continue
            if pos != e.lens[layer]:
                errors[rid] = f"position {pos} at layer {layer}, expected {e.lens[layer]}"
                continue
            if pos >= e.capacity:
                errors[rid] = f"reserve of {e.capacity} tokens used up"
                continue
            e.kv[layer, :, :, pos] = qkv[i, H:].reshape(2, Hk, D)  # this token's k, v
            e.lens[layer] = pos + 1
            rows.append(i)
            kvs.append(e.kv[layer])
            lens.append(pos + 1)
        if rows:
            # one padded batch per length group, not one call per request (batched.py says why)
            q = qkv[:, :H] if len(rows) == B else qkv[rows, :H]
            o = out if len(rows) == B else torch.empty((len(rows), H * D), dtype=qkv.dtype)
            attend_rows(kvs, lens, q, scale, o)
            if len(rows) < B:
                out[rows] = o
        return out, errors

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                num_requests=len(self._entries),
                kv_tokens=sum(min(e.lens) for e in self._entries.values()),
                used_bytes=self.used_bytes,
                capacity_bytes=self.capacity_bytes,
                num_offloads=self.num_offloads,
                num_recalls=self.num_recalls,
                num_refused=self.num_refused,
            )
