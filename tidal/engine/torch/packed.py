"""oneDNN-packed copies of the weight matrices for multi-row matmuls on CPU (fp32, bf16, fp16).

`F.linear` on a plain (out, in) bf16 weight makes oneDNN reorder the weight into its blocked
GEMM layout on every call: at SmolLM2's sizes that reorder is most of a batch-8..64 matmul.
`torch.ops.mkldnn._reorder_linear_weight` does it once at load (what inductor's freezing pass
does for a compiled model), and `torch.ops.mkldnn._linear_pointwise` runs on the packed copy.
Measured on the 2-core Zen 4 VM, 30 layers' matmuls at one thread: 2.0x faster at batch 8 and 32
(docs/engine.md). Exact: the packed GEMM gives bit-identical results to `F.linear` at any row
count (the packing's batch hint only picks the blocking).

Not every CPU can: oneDNN packs bf16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (fp16 with
AVX512-FP16 or AVX-NE-CONVERT), so `cpu_caps.can_pack` says whether to (a one-time trial of
these ops); where it is refused, multi-row matmuls run on the plain weight (`F.linear`).
fp32 packs on AVX2 too, where it gains most: an fp32 model's (in, out) matrices, which serve
its one-row GEMVs (`llama.weight_layout`), are packed from their transpose, 1.3-2x faster than
either plain layout at 8-128 rows (docs/engine.md).

One-row matmuls keep ATen's native GEMV on the plain weight (faster still at batch 1, see
`llama.weight_layout`), so both copies are kept: weights take twice the memory, which is why
only models up to `PACK_MAX_BYTES` of matrices are packed.
"""

from __future__ import annotations

import torch

PACK_BATCH_HINT = 32  # the batch oneDNN picks its blocking for (any row count runs on it)
PACK_MAX_BYTES = 4 << 30  # past this, a second copy of the weights costs too much memory


def pack(w: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of a plain (out, in) weight."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)


def gemv_native(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x (1, in) @ w.T (+ b) on the plain (out, in) weight with oneDNN off for this call only:
    ATen's own GEMV, whose per-call cost beats oneDNN's at one row (`llama.weight_layout`),
    while the attention's batched matmuls keep oneDNN. Written into `out` when given."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        if out is None:
            return torch.nn.functional.linear(x, w, b)
        return torch.mm(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)
    finally:
        torch._C._set_mkldnn_enabled(was)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (n, in) @ W^T + b with W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")
