"""Steps on native kernels, on CPU: every step whose rows all start at layer 0 (decodes, and
prefill chunks beside or without them).

At batch 1 a SmolLM2 layer's four GEMVs take ~9 ms of a ~16 ms step; the rest was ~15 small torch
ops a layer (RMSNorm, RoPE, KV write, attention, SiLU*mul, residual adds), each a 5-30 us dispatch
around microseconds of work, and at batch 32 the same ops still cost their dispatch. Here the small
work runs as three or four calls a layer into `tidal.engine.torch.native`; the matmuls stay torch's
(the native bf16 GEMV at one row, `gemv`, written into buffers made once; oneDNN's packed GEMM
at more, `llama.linear`):

    add+norm -> qkv matmul -> RoPE+KV write -> attention -> o matmul -> add+norm
    -> gate_up matmul -> SiLU*mul -> down matmul   (the next layer's add+norm adds its output)

Attention is the native kernel, row by row over each row's own slots (no gathered copy of the
batch's KV: at batch 32 the gather and the padded batched matmuls were half of a bf16 step), up
to `NATIVE_MAX_T` tokens, else the engine's `attention.ATTENTION` (batched matmuls over gathered
KV; SDPA for a long lone context); prefill rows attend with `attention.ATTENTION` (SDPA), the
decode rows beside them still on the kernel. `LlamaModel.forward_layers` takes this path when
`NativeDecode.fits` says so; both paths compute the same values to the model dtype's rounding
(the kernels round where the torch ops do). A bf16 model runs bf16 matmul inputs and outputs; an
fp32 model fp32 ones (`_f32io` kernels), or bf16 on the rows its bf16 weight copies serve.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tidal.engine.torch import attention, gemv
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
_LANES = 16  # the attention runs over a head in vectors of up to this many floats (`LANES`)
_MAX_SCRATCH = 64  # score blocks (256 KiB each): the most threads the attention splits over


def scratch_blocks() -> int:
    """Score blocks to keep: one per thread the attention may split over (torch's thread count
    or this process's cores, whichever is more, at most `_MAX_SCRATCH`)."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere the CPU count
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(_MAX_SCRATCH, max(torch.get_num_threads(), cores)))


class Kernels:
    """One IO dtype's kernels (the matmuls' inputs and outputs) and its one-row buffers."""

    def __init__(self, lib: ctypes.CDLL, sfx: str, io: torch.dtype, model: DecodeModel) -> None:
        cfg = model.config
        self.io = io
        self.add_rms_norm = getattr(lib, "tidal_add_rms_norm" + sfx)
        self.rope_kv_write = getattr(lib, "tidal_rope_kv_write" + sfx)
        self.decode_attention = getattr(lib, "tidal_decode_attention" + sfx)
        self.attention_rows = getattr(lib, "tidal_decode_attention_rows" + sfx)
        self.silu_mul = getattr(lib, "tidal_silu_mul" + ("_f32io" if sfx == "_f32io" else ""))

        def buf(width: int) -> torch.Tensor:
            return torch.empty(1, width, dtype=io, device=model.device)

        # one row: every matmul writes into these (ATen's GEMV, `torch.mm(..., out=)`)
        self.h, self.qkv = buf(cfg.hidden_size), buf(cfg.q_size + 2 * cfg.kv_size)
        self.attn, self.o = buf(cfg.q_size), buf(cfg.hidden_size)
        self.gu, self.act = buf(2 * cfg.intermediate_size), buf(cfg.intermediate_size)
        self.down = buf(cfg.hidden_size)


class NativeDecode:
    """Weight pointers and one-row buffers for one model's decode steps."""

    def __init__(self, model: DecodeModel, lib: ctypes.CDLL) -> None:
        cfg = model.config
        self.model, self.lib = model, lib
        self.H, self.Hk, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # the kernels keep a KV head's query heads and a head's width in stack buffers, and
        # take the head's width in whole steps of their dot products' lanes
        self.shapes_fit = self.H // self.Hk <= _MAX_G and self.D <= _MAX_D and self.D % _LANES == 0
        self.hidden, self.eps = cfg.hidden_size, float(cfg.rms_norm_eps)
        self.inter = cfg.intermediate_size
        self.qkv_width = cfg.q_size + 2 * cfg.kv_size
        # residual, norms, RoPE tables and KV in the model's dtype; the matmuls' inputs and
        # outputs in theirs: a bf16 model's bf16 (plain kernels), an fp32 one's fp32 (`_f32io`)
        # and, for the rows its bf16 weight copies serve (`small_rows`), bf16 (`_f32`)
        fp32 = model.dtype == torch.float32
        self.small = model.small if fp32 else None
        self.full = (
            Kernels(lib, "_f32io", torch.float32, model)
            if fp32
            else Kernels(lib, "", torch.bfloat16, model)
        )
        self.split = None if self.small is None else Kernels(lib, "_f32", torch.bfloat16, model)
        # a lone row's four matmuls a layer on the native GEMV, straight from these tables (the
        # checks of `gemv.gemv` made once): a bf16 model's own matrices, an fp32 one's copies
        self.gemv_fn = gemv.kernel()
        self.gemv_full = None if fp32 else _gemv_table(model, None)
        self.gemv_split = None if self.small is None else _gemv_table(model, self.small)
        # a block of score scratch for each thread of the team the attention splits over
        self.n_scratch = scratch_blocks()
        self.scores = torch.empty(self.n_scratch * _MAX_G * NATIVE_MAX_T, dtype=torch.float32)
        self.norms = [(lay.in_norm.data_ptr(), lay.post_norm.data_ptr()) for lay in model.layers]

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether this path computes every row of this step (else torch's path): its rows all
        start at layer 0, decodes first, then any prefill chunks (their attention is
        `attention.ATTENTION`'s, `NativeDecode.attention`), not on an fp32 model's bf16 copies.
        The model is a CPU bf16 one, whose weights are (out, in) as HF has them
        (`llama.weight_layout`), or an fp32 one ((in, out), bf16 copies for small rows)."""
        if len(batch.groups) != 1 or batch.groups[0][0] != 0:
            return False  # rows resumed after a preemption start at a later layer
        n, meta = batch.hidden.shape[0], batch.groups[0][2]
        if meta.prefills and self.small is not None and self.small.applies(n):
            # NOTE: the bf16-IO kernels would round a prefill row's q to bf16 after RoPE where
            # the torch path keeps it fp32; such a step's rows are the copies' anyway
            return False
        rows = meta.decode_rows
        decodes_first = isinstance(rows, slice) and rows.start in (None, 0) and rows.step is None
        return (
            (rows == slice(0, n) or (bool(meta.prefills) and decodes_first))
            and self.shapes_fit
            and batch.hidden.is_contiguous()
        )

    def run(
        self,
        batch: ForwardBatch,
        kv_views: list[tuple[torch.Tensor, torch.Tensor]],
        should_stop: Callable[[], bool] | None,
    ) -> int:
        """Every layer on `batch.hidden` in place; returns how many layers ran (all of them
        unless `should_stop()` turned true at a layer boundary)."""
        model = self.model
        H, Hk, D, n, eps = self.H, self.Hk, self.D, self.hidden, self.eps
        x = batch.hidden
        B = x.shape[0]
        meta = batch.groups[0][2]
        split = self.small is not None and self.small.applies(B)
        k = self.split if split and self.split is not None else self.full
        one = B == 1  # a lone decode (a one-token prefill chunk is a decode row too)
        table = (self.gemv_split if split else self.gemv_full) if one and self.gemv_fn else None
        mixed = bool(meta.prefills)
        ctx = _context(meta) if one else None
        start, T, slots = ctx if ctx is not None else (0, 0, None)
        ctx_p = slots.data_ptr() if slots is not None else None
        rows = None if one or mixed else _rows(meta)  # (slots (B, Tmax), lens (B,)) of a batch
        native_attn = (ctx is not None and T <= NATIVE_MAX_T) or rows is not None
        positions = batch.positions.contiguous()
        slot_map = batch.slot_mapping.contiguous()
        pos_p, slot_p = positions.data_ptr(), slot_map.data_ptr()
        cos_p, sin_p = model.cos.data_ptr(), model.sin_rot.data_ptr()
        h = k.h if one else torch.empty(B, n, dtype=k.io)
        act = k.act if one else torch.empty(B, self.inter, dtype=k.io)
        attn = k.attn if one else torch.empty(B, H * D, dtype=k.io)
        xp, hp, actp, attn_p = x.data_ptr(), h.data_ptr(), act.data_ptr(), attn.data_ptr()
        down: torch.Tensor | None = None
        L = len(model.layers)
        for li, lay in enumerate(model.layers):
            in_norm, post_norm = self.norms[li]
            k_cache, v_cache = kv_views[li]
            kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
            k.add_rms_norm(xp, None if down is None else down.data_ptr(), in_norm, hp, B, n, eps)
            m_qkv, m_o, m_gu, m_down = _NO_GEMV if table is None else table[li]
            qkv = self._mm(h, lay.qkv, k.qkv, lay.qkv_bias, split, m_qkv)
            k.rope_kv_write(
                qkv.data_ptr(), self.qkv_width, cos_p, sin_p, pos_p, kp, vp, slot_p, B, H, Hk, D
            )
            if rows is not None:
                slots_b, lens = rows
                k.attention_rows(
                    qkv.data_ptr(), self.qkv_width, kp, vp, slots_b.data_ptr(), lens.data_ptr(),
                    slots_b.shape[1], B, H, Hk, D, model.scale, self.scores.data_ptr(),
                    self.n_scratch, attn_p,
                )  # fmt: skip
            elif native_attn:
                k.decode_attention(
                    qkv.data_ptr(), kp, vp, ctx_p, start, T, H, Hk, D, model.scale,
                    self.scores.data_ptr(), self.n_scratch, attn_p,
                )  # fmt: skip
            else:
                # prefills beside the decodes (or a context past the kernel's): the decode rows
                # on the kernel still, as in a step of decodes alone
                q = qkv[:, : H * D].view(B, H, D).to(model.dtype)
                attn = self.attention(q, k_cache, v_cache, meta, model.scale).to(k.io)
            o = self._mm(attn, lay.o, k.o, None, split, m_o)
            k.add_rms_norm(xp, o.data_ptr(), post_norm, hp, B, n, eps)
            gu = self._mm(h, lay.gate_up, k.gu, None, split, m_gu)
            k.silu_mul(gu.data_ptr(), actp, B, self.inter)
            down = self._mm(act, lay.down, k.down, None, split, m_down)
            if should_stop is not None and li + 1 < L and should_stop():
                x += down
                return li + 1
        assert down is not None
        x += down
        return L

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMeta,
        scale: float,
    ) -> torch.Tensor:
        """`attention.ATTENTION`'s contract, for the steps `run` does not take (prefills beside
        the decodes, rows resumed at a later layer, piggybacked or timed steps): the decode rows
        on the same kernel `run` gives them, the prefills (and what the kernel cannot take)
        on `attention.ATTENTION`. So a decode row's attention rounds the same whether or not a
        prefill shares its step: the torch path's batched matmuls round scores and
        probabilities to bf16, the kernel once, and a seeded request sent again, batched
        otherwise, sampled other tokens (see `ROW_ATTENTION`)."""
        n, H, D = q.shape
        B, T, span = _decode_rows(meta)
        k = self.full
        if (
            B == 0
            or T > NATIVE_MAX_T
            or not self.shapes_fit  # stack buffers (G <= _MAX_G, D <= _MAX_D), D in whole vectors
            or (B > 1 and not ROW_ATTENTION)
            or q.dtype != k.io
            or k_cache.dtype != self.model.dtype
            or q.device.type != "cpu"
            or q.stride(2) != 1
            or q.stride(1) != D
        ):
            return attention.ATTENTION(q, k_cache, v_cache, meta, scale)
        if meta.prefills:  # their rows of the output; the decode rows' are written below
            rest = dataclasses.replace(
                meta,
                decode_rows=slice(0, 0),
                decode_slots=None,
                decode_bias=None,
                decode_kv_rows=None,
                decode_lens=None,
                decode_span=None,
            )
            out = attention.ATTENTION(q, k_cache, v_cache, rest, scale)
        else:
            out = torch.empty(n, H * D, dtype=q.dtype)
        rows = meta.decode_rows
        direct = isinstance(rows, slice) and rows.step in (None, 1) and out.is_contiguous()
        if direct:
            assert isinstance(rows, slice)
            r0 = rows.start or 0
            qd, od = q[r0 : r0 + B], out[r0 : r0 + B]
        else:
            qd, od = q[rows].contiguous(), torch.empty(B, H * D, dtype=q.dtype)
        kp, vp, sp = k_cache.data_ptr(), v_cache.data_ptr(), self.scores.data_ptr()
        if span is not None:
            k.decode_attention(
                qd.data_ptr(), kp, vp, None, span[0], span[1], H, self.Hk, D, scale, sp,
                self.n_scratch, od.data_ptr(),
            )  # fmt: skip
        else:
            assert meta.decode_slots is not None and meta.decode_lens is not None
            slots, lens = meta.decode_slots.contiguous(), meta.decode_lens.contiguous()
            k.attention_rows(
                qd.data_ptr(), qd.stride(0), kp, vp, slots.data_ptr(), lens.data_ptr(),
                slots.shape[1], B, H, self.Hk, D, scale, sp, self.n_scratch, od.data_ptr(),
            )  # fmt: skip
        if not direct:
            out[rows] = od
        return out

    def _mm(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor,
        b: torch.Tensor | None,
        split: bool,
        mat: _GemvMat | None = None,
    ) -> torch.Tensor:
        """x @ w.T (+ b): into `out` on the native GEMV where `mat`, w's (or its copy's) entry
        of a `_gemv_table`, is given (one row); on the bf16 copies where they serve these rows
        (`split`); else into `out` at one row (`gemv`, on (in, out) fp32 matrices a plain mm),
        and the model's packed GEMM for more."""
        if mat is not None:
            assert self.gemv_fn is not None  # a table is only used with the kernel
            self.gemv_fn(x.data_ptr(), mat[0], mat[1], out.data_ptr(), mat[2], mat[3])
            return out
        if split:
            assert self.small is not None
            return self.small.linear(x, w, b, out=out)
        if x.shape[0] > 1:
            return self.model._linear(x, w, b)
        if self.model.dtype == torch.float32:  # (in, out): `llama.weight_layout`
            return torch.mm(x, w, out=out) if b is None else torch.addmm(b, x, w, out=out)
        return gemv.gemv(x, w, b, out=out)


_GemvMat = tuple[int, int | None, int, int]  # (weight, bias or None: addresses; in, out)
_NO_GEMV: tuple[None, None, None, None] = (None, None, None, None)


def _gemv_table(model: DecodeModel, small: SmallRowWeights | None) -> list[list[_GemvMat]] | None:
    """Per layer, the native GEMV's entries for its qkv, o, gate_up and down matmuls (on the
    bf16 copies in `small` where given, else the model's own matrices), or None where one of them
    does not fit it (`gemv.weight_fits`: not bf16, or a width the kernel does not take)."""
    table = []
    for lay in model.layers:
        row: list[_GemvMat] = []
        for w, b in ((lay.qkv, lay.qkv_bias), (lay.o, None), (lay.gate_up, None), (lay.down, None)):
            wl = w if small is None else small.copy_of(w)
            bl = b if small is None or b is None else small.copy_of(b)
            if not gemv.weight_fits(wl, bl):
                return None
            bp = None if bl is None else bl.data_ptr()
            row.append((wl.data_ptr(), bp, wl.shape[1], wl.shape[0]))
        table.append(row)
    return table


# Batches' decode rows attend on the native kernel, row by row over each row's own slots
# (`attention_rows`; per row the same bits as the lone row's `decode_attention`). It was off
# for a while: a seeded n=3 bf16 request sent twice on the stack gave other text in 3 of 6 runs
# (tests/e2e/test_openai_fields.py::test_n). The kernel was right; the choices' steps were not
# the same: a choice arriving a little later prefills beside the others' decodes, and such a
# mixed step ran the torch path, whose attention rounds scores and probabilities to bf16 (and
# whose norms and RoPE differ from the kernels' in the last bit now and then), while a step of
# decodes alone ran the kernels: the same row got other logits by what shared its step. Now
# `run` takes mixed steps too (the prefill rows' attention stays `attention.ATTENTION`'s) and
# the torch path's decode rows attend on the kernel (`NativeDecode.attention`), so a decode
# row's bits do not depend on the prefills beside it. What still does: a row alone in its
# step (ATen's one-row GEMV, and the LM head's, against oneDNN's GEMM for more rows), an fp32
# model's bf16 weight copies (up to N rows), rows resumed after a layer cut or beside
# piggybacked ones (torch's norms and RoPE); as before, and off or on alike.
ROW_ATTENTION = True


def _rows(meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(slots (B, Tmax), lens (B,)) of a batch of decode rows the native kernel can attend, or
    None (`attention.ATTENTION` then; always while `ROW_ATTENTION` is off)."""
    slots, lens = meta.decode_slots, meta.decode_lens
    if not ROW_ATTENTION or slots is None or lens is None or slots.shape[1] > NATIVE_MAX_T:
        return None
    if slots.dtype != torch.int64 or lens.dtype != torch.int64 or slots.device.type != "cpu":
        return None
    return slots.contiguous(), lens.contiguous()


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


def _decode_rows(meta: AttnMeta) -> tuple[int, int, tuple[int, int] | None]:
    """(decode rows, longest context, in-place (start, T) of a lone one or None) of a step's
    attention inputs; (0, 0, None) where the kernel cannot take them (no decode rows, slots
    not int64 on CPU, no context lengths)."""
    if meta.decode_span is not None:
        return 1, meta.decode_span[1], meta.decode_span
    slots, lens = meta.decode_slots, meta.decode_lens
    if slots is None or lens is None or slots.device.type != "cpu":
        return 0, 0, None
    if slots.dtype != torch.int64 or lens.dtype != torch.int64:
        return 0, 0, None
    return int(slots.shape[0]), int(slots.shape[1]), None
