"""What a CPU-attention worker's decode attention could cost at best, measured on the worker's
own cores (for `tidal bench cpu-attn`).

Decode attention reads each request's K and V once per layer and does 3 flops per byte read
(SmolLM2: 3 query heads per KV head, 2 flops each per bf16 element), so on a CPU it is bound by
memory bandwidth (OmniServe §3.2 sizes its CPU workers the same
way). The bound of one layer frame is its KV bytes ÷ the core's memory bandwidth, measured here
as STREAM's Copy (bytes read + bytes written per second of a large `copy_`, which overstates a
read-only stream a little and so keeps the bound honest, i.e. low). `isolated_attention` times
the worker's own `KvStore.attend` on synthetic KV, alone on those cores, between the two.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from services.common import affinity


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes_per_token_layer(self, item_bytes: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * item_bytes  # K and V


# SmolLM2-135M(-Instruct) config.json: 30 layers, 9 query heads, 3 KV heads of 64.
SMOLLM2_135M = Geometry(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@contextlib.contextmanager
def on_cores(cores: Iterable[int]) -> Iterator[int]:
    """This process (every thread) on `cores` with one torch thread each; restored after.
    Yields the thread count."""
    import torch

    mask = tuple(cores)
    before, threads = affinity.allowed_cores(), torch.get_num_threads()
    if mask:
        affinity.pin(mask)
        torch.set_num_threads(len(mask))
    try:
        yield torch.get_num_threads()
    finally:
        affinity.pin(before)
        torch.set_num_threads(threads)


def copy_gb_per_s(num_bytes: int = 1 << 28, repeats: int = 7) -> float:
    """STREAM Copy bandwidth of this process's cores: 2 x bytes / time of `b.copy_(a)` with
    arrays far larger than any cache, the best of `repeats` as STREAM reports it (the least
    disturbed by other processes on a shared machine; GB = 1e9 bytes)."""
    import torch

    a = torch.ones(num_bytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # touch every page first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * num_bytes / min(times) / 1e9


def isolated_attention(
    num_rows: int, context_tokens: int, dtype: str, geo: Geometry = SMOLLM2_135M, repeats: int = 20
) -> dict[str, float]:
    """`KvStore.attend` of one layer frame of `num_rows` requests at `context_tokens` each, on
    synthetic KV, in this thread: median wall and thread-CPU seconds and KV bytes per frame (CPU
    time leaves out the time other processes held the core)."""
    import torch

    from tidal.cpu_attn.kv_store import KvStore

    dt = getattr(torch, dtype)
    H, Hk, D = geo.num_heads, geo.num_kv_heads, geo.head_dim
    L = 1  # the per-frame cost does not depend on the other layers
    store = KvStore(1 << 34)
    ids = [f"r{i}" for i in range(num_rows)]
    for rid in ids:
        store.put(rid, torch.randn(L, 2, context_tokens, Hk, D).to(dt), reserve_tokens=repeats + 1)
    times, cpu = [], []
    for step in range(repeats):
        qkv = torch.randn(num_rows, H + 2 * Hk, D).to(dt)
        pos = [context_tokens + step] * num_rows
        t0, c0 = time.perf_counter(), time.thread_time()
        store.attend(0, ids, pos, qkv, H, D**-0.5)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    ctx = context_tokens + repeats // 2  # the median step's context, about
    kv_bytes = num_rows * ctx * geo.kv_bytes_per_token_layer(ITEM_BYTES[dtype])
    return {
        "frame_s": statistics.median(times),
        "frame_cpu_s": statistics.median(cpu),
        "kv_bytes": float(kv_bytes),
    }


def measure(cores: Iterable[int], num_rows: int, context_tokens: int, dtype: str) -> dict[str, Any]:
    """Copy bandwidth and isolated attention on `cores` (the first worker's), as JSON."""
    mask = tuple(cores)
    with on_cores(mask) as threads:
        bw = copy_gb_per_s()
        iso = isolated_attention(num_rows, context_tokens, dtype)
    bound_s = iso["kv_bytes"] / (bw * 1e9)
    return {
        "cores": affinity.format_cores(mask) if mask else "unpinned",
        "threads": threads,
        "copy_gb_per_s": round(bw, 2),
        "isolated": {
            "rows": num_rows,
            "context_tokens": context_tokens,
            "dtype": dtype,
            "us_per_frame": round(1e6 * iso["frame_s"], 1),
            "cpu_us_per_frame": round(1e6 * iso["frame_cpu_s"], 1),
            "kv_kb_per_frame": round(iso["kv_bytes"] / 1e3, 1),
            "bound_us_per_frame": round(1e6 * bound_s, 1),
            "x_bound": round(iso["frame_s"] / bound_s, 2),
        },
    }


def live_bound(
    result: dict[str, Any], copy_gb_per_s: float, dtype: str, geo: Geometry = SMOLLM2_135M
) -> dict[str, float | None]:
    """A live phase's worker attention per instance step (one frame per layer) against the
    bandwidth bound of the KV it read: from the workers' frame, row and context counters."""
    frames = result.get("worker_attn_frames") or 0
    if not frames:
        return {"attn_ms_per_step": None, "kv_mb_per_step": None, "bound_ms_per_step": None}
    per_tl = geo.kv_bytes_per_token_layer(ITEM_BYTES[dtype])
    kv_per_step = geo.num_layers * result["worker_ctx_tokens"] / frames * per_tl
    attn_per_step = geo.num_layers * result["worker_attn_s"] / frames
    bound = kv_per_step / (copy_gb_per_s * 1e9)
    return {
        "attn_ms_per_step": round(1e3 * attn_per_step, 2),
        "kv_mb_per_step": round(kv_per_step / 1e6, 2),
        "bound_ms_per_step": round(1e3 * bound, 3),
        "x_bound": round(attn_per_step / bound, 1),
        "rows_per_frame": round(result["worker_attn_rows"] / frames, 1),
    }
