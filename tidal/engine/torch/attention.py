"""Paged attention for the torch engine: the inputs a step's rows attend with (`AttnMeta`) and
the default kernel, `sdpa_paged_attention`. `ATTENTION` is the one swappable function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """Attention inputs of one multi-token item."""

    row_start: int
    row_end: int
    ctx_slots: torch.Tensor  # (T,) KV slots of the whole context, new tokens included
    mask: torch.Tensor | None  # (n, T) bool, True = attend; None = plain causal (T == n)


@dataclass
class AttnMeta:
    """Attention inputs for the rows active at some layer."""

    decode_rows: torch.Tensor | slice  # rows of single-token items
    decode_slots: torch.Tensor | None  # (B, T) KV slots per decode row, padded
    decode_bias: torch.Tensor | None  # (B, 1, 1, T) 0 or -inf; None when no slot is padding
    decode_kv_rows: torch.Tensor | None = None  # (B*Hk*T,) rows of the (slots*Hk, D) cache view
    decode_lens: torch.Tensor | None = None  # (B,) int64 on CPU: each decode row's context length
    # one decode row whose context is the slot range [start, start + T): attention reads the
    # cache in place, no gather (a lone stream's blocks are consecutive); decode_slots is None
    decode_span: tuple[int, int] | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnMeta, float], torch.Tensor]


def sdpa_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta, scale: float
) -> torch.Tensor:
    """q (n, H, D); caches (slots, Hk, D) already hold this step's K/V. Returns (n, H*D).

    Decodes: the G query heads sharing a KV head are folded into one (G, D) query block, so GQA
    needs no repeated KV, and plain matmuls beat SDPA's CPU kernels at one query per request
    for a batch. A lone decode row (batch 1, the interactive case) is one SDPA call instead:
    on the cache in place when its slots are consecutive (`decode_span`), else on the gathered
    context up to `SDPA_MAX_SINGLE_T` tokens.
    Prefill chunks: SDPA with `enable_gqa`, causal (or a bottom-right causal mask after a prefix).
    """
    n, H, D = q.shape
    Hk = k_cache.shape[1]
    G = H // Hk
    only_decodes = not meta.prefills and meta.decode_rows == slice(0, n)
    out = q if only_decodes else torch.empty_like(q)
    if meta.decode_span is not None:  # one decode row over consecutive slots
        start, T = meta.decode_span
        qd = q[meta.decode_rows].view(1, Hk, G, D)
        kd = k_cache[start : start + T].transpose(0, 1).unsqueeze(0)  # (1, Hk, T, D) view
        vd = v_cache[start : start + T].transpose(0, 1).unsqueeze(0)
        od = F.scaled_dot_product_attention(qd, kd, vd, scale=scale)  # (1, Hk, G, D)
        if only_decodes:
            return od.view(n, H * D)
        out[meta.decode_rows] = od.view(1, H, D)
    if meta.decode_slots is not None:
        qd = q[meta.decode_rows].view(-1, Hk, G, D)  # (B, Hk, G, D)
        B, T = meta.decode_slots.shape
        # NOTE: gather (slot, head) rows straight into a contiguous (B, Hk, T, D): batched
        # matmuls on a strided (B, T, Hk, D) view run 2x slower, and a copy costs bandwidth.
        rows = meta.decode_kv_rows
        assert rows is not None
        kd = k_cache.view(-1, D).index_select(0, rows).view(B, Hk, T, D)
        vd = v_cache.view(-1, D).index_select(0, rows).view(B, Hk, T, D)
        if B == 1 and T <= SDPA_MAX_SINGLE_T:
            # NOTE: one row: SDPA's fused CPU kernel is one call where the matmul path is five
            # (bf16, T = 100: 26 vs 49 us a layer); past a few hundred tokens it loses
            od = F.scaled_dot_product_attention(qd, kd, vd, scale=scale)
            if only_decodes:
                return od.view(n, H * D)
            out[meta.decode_rows] = od.view(1, H, D)
            return _prefills(q, k_cache, v_cache, meta, scale, out)
        s = torch.matmul(qd, kd.transpose(-1, -2)) * scale  # (B, Hk, G, T)
        if meta.decode_bias is not None:  # padded slots of shorter contexts
            s += meta.decode_bias
        s = s.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        od = torch.matmul(s, vd)  # (B, Hk, G, D)
        if only_decodes:
            return od.view(n, H * D)
        out[meta.decode_rows] = od.reshape(B, H, D)
    return _prefills(q, k_cache, v_cache, meta, scale, out)


def _prefills(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMeta,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    n, H, D = q.shape
    for p in meta.prefills:
        qp = q[p.row_start : p.row_end].transpose(0, 1).unsqueeze(0)  # (1, H, m, D)
        kp = k_cache.index_select(0, p.ctx_slots).transpose(0, 1).unsqueeze(0)  # (1, Hk, T, D)
        vp = v_cache.index_select(0, p.ctx_slots).transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )  # (1, H, m, D)
        out[p.row_start : p.row_end] = op[0].transpose(0, 1)
    return out.view(n, H * D)


ATTENTION: AttentionFn = sdpa_paged_attention
SDPA_MAX_SINGLE_T = 512  # one gathered decode row: SDPA up to this context, matmuls past it


@dataclass
class ForwardBatch:
    """One forward pass's rows: what `llama.LlamaModel.forward_layers` runs."""

    hidden: torch.Tensor  # (N, hidden) embeddings or resumed hidden states
    positions: torch.Tensor  # (N,)
    slot_mapping: torch.Tensor  # (N,) KV slot each row writes
    # (first layer, number of active rows, meta) per group, ascending in first layer
    groups: list[tuple[int, int, AttnMeta]]
