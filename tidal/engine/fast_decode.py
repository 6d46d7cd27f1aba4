"""The one-row decode step on native kernels: the interactive case (a lone stream) on CPU.

At batch 1 a layer's four GEMVs take ~9 ms of a SmolLM2 step's ~16 ms; the rest was ~15 small
torch ops a layer (RMSNorm, RoPE, KV write, attention, SiLU*mul, residual adds), each a 5-30 us
dispatch around microseconds of work. Here those run as three calls a layer into
`tidal.engine.native` and the GEMVs write into buffers made once, so a layer is seven calls:

    add+norm -> qkv GEMV -> RoPE+KV write -> attention -> o GEMV -> add+norm -> gate_up GEMV
    -> SiLU*mul -> down GEMV   (the down output is added by the next layer's add+norm)

`LlamaModel.forward_layers` takes this path when `OneRowDecode.fits` says so and computes the
same values either way (to bf16 rounding: the kernels round where the torch ops do).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tidal.engine.attention import AttnMeta

if TYPE_CHECKING:
    from tidal.engine.llama import ForwardBatch, LlamaModel

# past this many context tokens torch's 2-thread SDPA beats the 1-thread kernel (measured:
# 74 vs 65 us a layer at 512 tokens, 38 vs 43 at 256; SmolLM2, bf16, this 2-core VM)
NATIVE_MAX_T = 512
_MAX_G, _MAX_D = 8, 256  # the kernels' stack buffers


class OneRowDecode:
    """Buffers and weight pointers for one model's one-row decode step."""

    def __init__(self, model: LlamaModel, lib: ctypes.CDLL) -> None:
        cfg = model.config
        self.model, self.lib = model, lib
        self.H, self.Hk, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden, self.eps = cfg.hidden_size, float(cfg.rms_norm_eps)
        inter = model.layers[0].down.shape[1]
        self.inter = inter

        def buf(width: int) -> torch.Tensor:
            return torch.empty(1, width, dtype=model.dtype, device=model.device)

        self.h = buf(self.hidden)
        self.qkv = buf(cfg.q_size + 2 * cfg.kv_size)
        self.attn = buf(cfg.q_size)
        self.o = buf(self.hidden)
        self.gu = buf(2 * inter)
        self.act = buf(inter)
        self.down = buf(self.hidden)
        self.scores = torch.empty(_MAX_G * NATIVE_MAX_T, dtype=torch.float32)
        # (out, in) weights as torch views for `torch.mm(x, w.t(), out=...)`: ATen's GEMV
        self.w = [(lay.qkv.t(), lay.o.t(), lay.gate_up.t(), lay.down.t()) for lay in model.layers]
        self.qkv_bias = [lay.qkv_bias for lay in model.layers]  # Qwen2's
        self.norms = [(lay.in_norm.data_ptr(), lay.post_norm.data_ptr()) for lay in model.layers]
        self.row_bytes = model.cos.shape[1] * model.cos.element_size()

    @staticmethod
    def fits(model: LlamaModel, batch: ForwardBatch) -> bool:
        """Whether this step is one decode row this path computes (else the torch path)."""
        cfg = model.config
        if model.device.type != "cpu" or model.dtype != torch.bfloat16 or model.transposed:
            return False
        if batch.hidden.shape[0] != 1 or len(batch.groups) != 1 or batch.groups[0][0] != 0:
            return False
        meta = batch.groups[0][2]
        G = cfg.num_attention_heads // cfg.num_key_value_heads
        return (
            not meta.prefills
            and G <= _MAX_G
            and cfg.head_dim <= _MAX_D
            and _context(meta) is not None
            and batch.hidden.is_contiguous()
        )

    def run(
        self,
        batch: ForwardBatch,
        kv_views: list[tuple[torch.Tensor, torch.Tensor]],
        should_stop: Callable[[], bool] | None,
    ) -> int:
        """Every layer on `batch.hidden` (1 row) in place; returns how many layers ran."""
        lib, H, Hk, D, n = self.lib, self.H, self.Hk, self.D, self.hidden
        ctx = _context(batch.groups[0][2])
        assert ctx is not None
        start, T, slots = ctx
        slots_p = slots.data_ptr() if slots is not None else None
        native_attn = T <= NATIVE_MAX_T
        x = batch.hidden
        xp, hp, qkvp = x.data_ptr(), self.h.data_ptr(), self.qkv.data_ptr()
        attnp, op, gup = self.attn.data_ptr(), self.o.data_ptr(), self.gu.data_ptr()
        actp, downp, scp = self.act.data_ptr(), self.down.data_ptr(), self.scores.data_ptr()
        pos = int(batch.positions[0])
        cosp = self.model.cos.data_ptr() + pos * self.row_bytes
        sinp = self.model.sin_rot.data_ptr() + pos * self.row_bytes
        slot = int(batch.slot_mapping[0])
        scale = self.model.scale
        h, qkv, attn, o, gu, act, down = (
            self.h,
            self.qkv,
            self.attn,
            self.o,
            self.gu,
            self.act,
            self.down,
        )
        pending = None  # the last down output, added by the next add+norm
        L = len(self.w)
        was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)  # ATen's own GEMV (see llama.weight_layout)
        try:
            for li in range(L):
                w_qkv, w_o, w_gu, w_down = self.w[li]
                in_norm, post_norm = self.norms[li]
                k_cache, v_cache = kv_views[li]
                kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
                lib.tidal_add_rms_norm(xp, pending, in_norm, hp, n, self.eps)
                bias = self.qkv_bias[li]
                if bias is None:
                    torch.mm(h, w_qkv, out=qkv)
                else:
                    torch.addmm(bias, h, w_qkv, out=qkv)
                lib.tidal_rope_kv_write(qkvp, cosp, sinp, kp, vp, slot, H, Hk, D)
                if native_attn:
                    lib.tidal_decode_attention(
                        qkvp, kp, vp, slots_p, start, T, H, Hk, D, scale, scp, attnp
                    )
                else:
                    attn.copy_(_sdpa(qkv, k_cache, v_cache, start, T, slots, H, Hk, D, scale))
                torch.mm(attn, w_o, out=o)
                lib.tidal_add_rms_norm(xp, op, post_norm, hp, n, self.eps)
                torch.mm(h, w_gu, out=gu)
                lib.tidal_silu_mul(gup, actp, self.inter)
                torch.mm(act, w_down, out=down)
                pending = downp
                if should_stop is not None and li + 1 < L and should_stop():
                    x += down
                    return li + 1
        finally:
            torch._C._set_mkldnn_enabled(was)
        x += down
        return L


def _context(meta: AttnMeta) -> tuple[int, int, torch.Tensor | None] | None:
    """(first slot, T, slots or None) of the one decode row's context, or None."""
    if meta.decode_span is not None:
        start, T = meta.decode_span
        return start, T, None
    if meta.decode_slots is not None and meta.decode_slots.shape[0] == 1:
        if meta.decode_bias is not None:
            return None
        slots = meta.decode_slots[0]
        return 0, int(slots.shape[0]), slots.contiguous()
    return None


def _sdpa(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    T: int,
    slots: torch.Tensor | None,
    H: int,
    Hk: int,
    D: int,
    scale: float,
) -> torch.Tensor:
    """torch's SDPA for a long context (2 threads beat the 1-thread kernel there)."""
    G = H // Hk
    q = qkv[:, : H * D].view(1, Hk, G, D)
    if slots is None:
        k, v = k_cache[start : start + T], v_cache[start : start + T]
    else:
        k, v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, scale=scale).view(1, H * D)
