"""Decode steps on native kernels: every step whose rows are all single-token decodes, on CPU.

At batch 1 a SmolLM2 layer's four GEMVs take ~9 ms of a ~16 ms step; the rest was ~15 small torch
ops a layer (RMSNorm, RoPE, KV write, attention, SiLU*mul, residual adds), each a 5-30 us dispatch
around microseconds of work, and at batch 32 the same ops still cost their dispatch. Here the small
work runs as three or four calls a layer into `tidal.engine.torch.native`; the matmuls stay torch's
(ATen's GEMV at one row, written into buffers made once; oneDNN's packed GEMM at more,
`llama.linear`):

    add+norm -> qkv matmul -> RoPE+KV write -> attention -> o matmul -> add+norm
    -> gate_up matmul -> SiLU*mul -> down matmul   (the next layer's add+norm adds its output)

Attention is the native kernel for one row over up to `NATIVE_MAX_T` tokens, else the engine's
`attention.ATTENTION` (batched matmuls over gathered KV; SDPA for a long lone context).
`LlamaModel.forward_layers` takes this path when `NativeDecode.fits` says so; both paths compute
the same values to bf16 rounding (the kernels round where the torch ops do).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tidal.engine.torch import attention, packed
from tidal.engine.torch.attention import AttnMeta, ForwardBatch
from tidal.engine.torch.model_config import ModelConfig
from tidal.engine.torch.small_rows import SmallRowWeights


class DecodeModel(Protocol):
    """What this path reads of the model that builds it (`llama.LlamaModel`)."""

    config: ModelConfig
    layers: list[Any]  # llama.LayerWeights: qkv, qkv_bias, o, gate_up, down and the norms
    dtype: torch.dtype
    device: torch.device
    cos: torch.Tensor
    sin_rot: torch.Tensor
    scale: float
    small: SmallRowWeights | None

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor: ...


# the 1-thread kernel beats torch's 2-thread SDPA at every length measured (SmolLM2, bf16, this
# 2-core VM: 21 vs 43 us a layer at 256 tokens, 151 vs 216 at 2048, 586 vs 803 at 8000); past
# this many tokens (its score buffer's size) the attention is torch's
NATIVE_MAX_T = 8192
_MAX_G, _MAX_D = 8, 256  # the kernels' stack buffers


class NativeDecode:
    """Weight pointers and one-row buffers for one model's decode steps."""

    def __init__(self, model: DecodeModel, lib: ctypes.CDLL) -> None:
        cfg = model.config
        self.model, self.lib = model, lib
        self.H, self.Hk, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden, self.eps = cfg.hidden_size, float(cfg.rms_norm_eps)
        self.inter = cfg.intermediate_size
        self.qkv_width = cfg.q_size + 2 * cfg.kv_size
        # a bf16 model, or an fp32 one with bf16 weight copies (`small_rows`): the matmuls'
        # inputs and outputs are bf16 either way; residual, norms, RoPE tables and KV in the
        # model's dtype, which picks the kernels (`_f32`: fp32 ones)
        self.small = model.small if model.dtype == torch.float32 else None
        if model.dtype == torch.float32 and self.small is None:
            raise ValueError("an fp32 model decodes natively only with bf16 weight copies")
        self.io = torch.bfloat16
        sfx = "_f32" if self.small is not None else ""
        self.add_rms_norm = getattr(lib, "tidal_add_rms_norm" + sfx)
        self.rope_kv_write = getattr(lib, "tidal_rope_kv_write" + sfx)
        self.decode_attention = getattr(lib, "tidal_decode_attention" + sfx)

        def buf(width: int) -> torch.Tensor:
            return torch.empty(1, width, dtype=self.io, device=model.device)

        # one row: every matmul writes into these (ATen's GEMV, `torch.mm(..., out=)`)
        self.h, self.qkv, self.attn = buf(self.hidden), buf(self.qkv_width), buf(cfg.q_size)
        self.o, self.gu = buf(self.hidden), buf(2 * self.inter)
        self.act, self.down = buf(self.inter), buf(self.hidden)
        self.scores = torch.empty(_MAX_G * NATIVE_MAX_T, dtype=torch.float32)
        self.norms = [(lay.in_norm.data_ptr(), lay.post_norm.data_ptr()) for lay in model.layers]

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether every row of this step is a decode this path computes (else torch's path).
        The model is a CPU bf16 one, whose weights are (out, in) as HF has them
        (`llama.weight_layout`), or an fp32 one whose bf16 copies serve this many rows."""
        cfg = self.model.config
        if len(batch.groups) != 1 or batch.groups[0][0] != 0:
            return False  # rows resumed after a preemption start at a later layer
        n, meta = batch.hidden.shape[0], batch.groups[0][2]
        return (
            not meta.prefills
            and meta.decode_rows == slice(0, n)
            and cfg.num_attention_heads // cfg.num_key_value_heads <= _MAX_G
            and cfg.head_dim <= _MAX_D
            and batch.hidden.is_contiguous()
            and (self.small is None or self.small.applies(n))
        )

    def run(
        self,
        batch: ForwardBatch,
        kv_views: list[tuple[torch.Tensor, torch.Tensor]],
        should_stop: Callable[[], bool] | None,
    ) -> int:
        """Every layer on `batch.hidden` in place; returns how many layers ran (all of them
        unless `should_stop()` turned true at a layer boundary)."""
        lib, model = self.lib, self.model
        H, Hk, D, n, eps = self.H, self.Hk, self.D, self.hidden, self.eps
        x = batch.hidden
        B = x.shape[0]
        meta = batch.groups[0][2]
        one = B == 1
        ctx = _context(meta) if one else None
        native_attn = ctx is not None and ctx[1] <= NATIVE_MAX_T
        start, T, slots = ctx if ctx is not None else (0, 0, None)
        ctx_p = slots.data_ptr() if slots is not None else None
        positions = batch.positions.contiguous()
        slot_map = batch.slot_mapping.contiguous()
        pos_p, slot_p = positions.data_ptr(), slot_map.data_ptr()
        cos_p, sin_p = model.cos.data_ptr(), model.sin_rot.data_ptr()
        h = self.h if one else torch.empty(B, n, dtype=self.io)
        act = self.act if one else torch.empty(B, self.inter, dtype=self.io)
        xp, hp, actp = x.data_ptr(), h.data_ptr(), act.data_ptr()
        down: torch.Tensor | None = None
        L = len(model.layers)
        for li, lay in enumerate(model.layers):
            in_norm, post_norm = self.norms[li]
            k_cache, v_cache = kv_views[li]
            kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
            self.add_rms_norm(xp, None if down is None else down.data_ptr(), in_norm, hp, B, n, eps)
            qkv = self._mm(h, lay.qkv, self.qkv, lay.qkv_bias)
            self.rope_kv_write(
                qkv.data_ptr(), self.qkv_width, cos_p, sin_p, pos_p, kp, vp, slot_p, B, H, Hk, D
            )
            if native_attn:
                attn = self.attn
                self.decode_attention(
                    qkv.data_ptr(), kp, vp, ctx_p, start, T, H, Hk, D, model.scale,
                    self.scores.data_ptr(), attn.data_ptr(),
                )  # fmt: skip
            else:
                q = qkv[:, : H * D].view(B, H, D).to(model.dtype)
                attn = attention.ATTENTION(q, k_cache, v_cache, meta, model.scale).to(self.io)
            o = self._mm(attn, lay.o, self.o)
            self.add_rms_norm(xp, o.data_ptr(), post_norm, hp, B, n, eps)
            gu = self._mm(h, lay.gate_up, self.gu)
            lib.tidal_silu_mul(gu.data_ptr(), actp, B, self.inter)
            down = self._mm(act, lay.down, self.down)
            if should_stop is not None and li + 1 < L and should_stop():
                x += down
                return li + 1
        assert down is not None
        x += down
        return L

    def _mm(
        self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ w.T (+ b): into `out` at one row (ATen's GEMV), else the model's packed GEMM;
        on the bf16 copies where the model has them."""
        if self.small is not None:
            return self.small.linear(x, w, b, out=out)
        if x.shape[0] > 1:
            return self.model._linear(x, w, b)
        return packed.gemv_native(x, w, b, out=out)


def _context(meta: AttnMeta) -> tuple[int, int, torch.Tensor | None] | None:
    """(first slot, T, slots or None) of a lone decode row's context, or None."""
    if meta.decode_span is not None:
        start, T = meta.decode_span
        return start, T, None
    if meta.decode_slots is not None and meta.decode_slots.shape[0] == 1:
        if meta.decode_bias is not None:
            return None
        slots = meta.decode_slots[0]
        return 0, int(slots.shape[0]), slots.contiguous()
    return None
