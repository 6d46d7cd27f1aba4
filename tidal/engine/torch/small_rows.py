"""bf16 copies of an fp32 model's matrices for its small-row matmuls: a weight dtype per shape.

Where oneDNN has no bf16 GEMM (an AVX2-only x86 CPU, `cpu_caps`), bf16 matmuls lose 2-4x at
batch 32 and in prefill, so the dtype calibration (`dtype_choice`) picks fp32 for the model; but
at one row a matmul is a GEMV bound by memory, and ATen's bf16 GEMV (fp32 accumulation) moves
half the bytes: ~3x faster. So an fp32 model can keep its residual stream, norms, RoPE tables and
KV cache in fp32 and run the matmuls of up to `max_rows` rows (decode steps of small batches; the
row count the calibration measured bf16 faster up to) on bf16 copies of its matrices, and larger
ones (prefill chunks, large batches) on its fp32 weights.

Numerics: such a matmul's input and output are rounded to bf16 and its weights are bf16 (the
bf16 model's numbers, less its bf16 residual stream and KV). Memory: the copies add half the
fp32 matrices (SmolLM2-135M: +270 MB with its LM head), so only models up to
`packed.PACK_MAX_BYTES` of weights get them, the bound the packed copies have.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from tidal.engine.torch import gemv

DTYPE = torch.bfloat16


class SmallRowWeights:
    """The bf16 copies of one fp32 model's matrices (HF's (out, in) layout, which ATen's bf16
    GEMV needs), its QKV biases and LM head, and the row count they serve up to."""

    def __init__(
        self,
        matrices: Iterable[torch.Tensor],
        biases: Iterable[torch.Tensor],
        lm_head: torch.Tensor,
        transposed: bool,
        max_rows: int,
    ) -> None:
        """`matrices` as the model holds them ((in, out) when `transposed`), `lm_head` (V,
        hidden)."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        # id of the model's fp32 matrix or bias -> its bf16 copy
        self.w: dict[int, torch.Tensor] = {}
        for m in matrices:
            self.w[id(m)] = (m.t() if transposed else m).to(DTYPE).contiguous()
        for b in biases:
            self.w[id(b)] = b.to(DTYPE)
        self.dtype = DTYPE
        self.lm_head = lm_head.to(DTYPE)
        self._lm_head_of = lm_head

    def applies(self, rows: int) -> bool:
        """Whether a matmul of `rows` rows runs on the copies."""
        return 0 < rows <= self.max_rows

    def linear(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (n, in) bf16 @ the copy of the model's `w` (+ its copy of `b`) -> (n, out) bf16;
        into `out` at one row (`gemv`)."""
        wl, bl = self.w[id(w)], None if b is None else self.w[id(b)]
        if x.shape[0] == 1:
            return gemv.gemv(x, wl, bl, out=out)
        return F.linear(x, wl, bl)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(n, hidden) normed fp32 states -> (n, V) fp32 logits on the bf16 LM head."""
        return self.linear_head(h.to(DTYPE)).float()

    def linear_head(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 1:
            return gemv.gemv(h, self.lm_head, None)
        return F.linear(h, self.lm_head)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """What a small-row step reads for the model's tensor `t`: its copy, if it has one."""
        return self.lm_head if t is self._lm_head_of else self.w.get(id(t), t)
