"""One-row matmuls on the plain (out, in) weight: the native bf16 GEMV where it fits, else ATen's.

A lone decode reads every weight once a step, so its time is the GEMVs' read bandwidth. ATen's
bf16 GEMV read SmolLM2-135M's 269 MB at 26-27 GB/s on the 2-core Zen 4 VM, where summing a large
tensor reads ~34: its rows (576 bf16, 1,152 B) are too short for the hardware prefetcher to run
ahead, and each call starts cold. The native one (`native/gemv.cpp`) asks for the next rows'
cache lines while it computes: 30 layers' GEMVs and the LM head in 8.1 ms instead of 9.9 (AVX-512
build), 9.0 instead of 10.2 (AVX2 build; docs/engine.md). Its sums run in another order than
ATen's, so the two agree to bf16 rounding, not bit for bit; every one-row bf16 matmul of the
engine goes through `gemv` (the native decode path, the torch path, the LM head, an fp32 model's
bf16 copies), so a row's bits do not depend on which path ran it.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.engine.torch import native, packed

CHUNK, MAX_IN = 16, 16384  # the native GEMV's input width: a multiple of, at most (gemv.cpp)


def kernel() -> Any | None:
    """The native bf16 GEMV (a ctypes function), or None where the kernels cannot be had."""
    lib = native.load()
    return None if lib is None else getattr(lib, native.GEMV)


def fits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the native GEMV takes x (1, in) @ w.T (+ b): the weight `weight_fits`, and x a
    contiguous bf16 (1, in) row on CPU."""
    return (
        weight_fits(w, b)
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and tuple(x.shape) == (1, w.shape[-1])
        and x.is_contiguous()
    )


def weight_fits(w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the native GEMV takes the weight w (out, in) and bias b: bf16, contiguous, on
    CPU, `in` a multiple of `CHUNK` up to `MAX_IN`."""
    n_in = w.shape[-1]
    return (
        w.dtype == torch.bfloat16
        and w.device.type == "cpu"
        and w.dim() == 2
        and n_in % CHUNK == 0
        and n_in <= MAX_IN
        and w.is_contiguous()
        and (b is None or _fits_bias(b, w.shape[0]))
    )


def _fits_bias(b: torch.Tensor, n_out: int) -> bool:
    return b.dtype == torch.bfloat16 and b.is_contiguous() and b.numel() == n_out


def gemv(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x (1, in) @ w.T (+ b) on the plain (out, in) weight, into `out` when given (contiguous,
    (1, out), of x's dtype): the native GEMV where it `fits`, else `packed.gemv_native`."""
    fn = kernel() if fits(x, w, b) else None
    if fn is None:
        return packed.gemv_native(x, w, b, out=out)
    y = torch.empty(1, w.shape[0], dtype=torch.bfloat16) if out is None else out
    if y.dtype != torch.bfloat16 or not y.is_contiguous() or y.numel() != w.shape[0]:
        raise ValueError(f"gemv: out must be a contiguous bf16 (1, {w.shape[0]}), got {y.shape}")
    bp = None if b is None else b.data_ptr()
    fn(x.data_ptr(), w.data_ptr(), bp, y.data_ptr(), w.shape[1], w.shape[0])
    return y
