"""Decode attention of many requests' KV in a few batched calls (for `KvStore.attend`).

One small attention call per request costs ~80-100 µs on one core whatever kernel runs it
(SDPA, or two bmm and a softmax: the per-call cost of oneDNN/MKL on a (3, 64) x (64, 400)
product, not the bytes), while the same work as one batched bmm over all requests runs near
the memory-bandwidth bound. So rows are grouped by context length, each group's KV is copied
into a zero-tailed padded scratch (2, n, Hk, T, D), and the group is two batched matmuls and a
masked fp32 softmax. The copy reads each KV byte once more, but leaves it in cache for the
matmuls. Padded lengths are rounded up to PAD_TO so the matmul shapes repeat step after step
(docs/cpu_attn.md, "Worker attention, before and after", has the figures).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

# a group's longest row is at most 1/0.8 of its shortest (bounds the padding to ~25%)
MIN_FILL = 0.8
# padded lengths are multiples of this: a bf16 bmm of a shape oneDNN has not seen costs ~0.6 ms
# to set up (measured, one core), so a length that grows a token per step must not be a new shape
PAD_TO = 64

_scratch = threading.local()


def _buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch of at least `numel` elements of `dtype`: grown by at least 1.5x,
    never shrunk, so contexts growing a token per step do not reallocate every step."""
    bufs: dict[torch.dtype, torch.Tensor] = getattr(_scratch, "bufs", None) or {}
    _scratch.bufs = bufs
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, 3 * (0 if buf is None else buf.numel()) // 2), dtype=dtype)
        bufs[dtype] = buf
    return buf[:numel]


def groups_by_length(lens: list[int], min_fill: float = MIN_FILL) -> list[list[int]]:
    """Row indices grouped so that a group's shortest row is >= min_fill x its longest."""
    if not 0 < min_fill <= 1:
        raise ValueError(f"min_fill must be in (0, 1], got {min_fill}")
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    out: list[list[int]] = []
    for i in order:
        if out and lens[i] >= min_fill * lens[out[-1][0]]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def attend_padded(
    kvs: list[torch.Tensor], lens: list[int], q: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query token per row over its first lens[j] keys and values.

    kvs[j]: (2, Hk, cap >= lens[j], D), one layer of row j's KV; q: (n, H, D), H a multiple
    of Hk (grouped-query heads share a KV head). -> (n, H, D) in q's dtype. Scores and softmax
    are fp32; the matmuls run in the KV's dtype with fp32 accumulation (as SDPA does)."""
    n, H, D = q.shape
    if n != len(kvs) or n != len(lens) or n == 0:
        raise ValueError(f"{n} query rows for {len(kvs)} KV and {len(lens)} lengths")
    Hk = int(kvs[0].shape[1])
    G = H // Hk
    dt = kvs[0].dtype
    T = -(-max(lens) // PAD_TO) * PAD_TO
    if min(lens) <= 0:
        raise ValueError(f"every row needs at least one token, got lengths {lens}")
    pad = _buffer(2 * n * Hk * T * D, dt).view(2, n, Hk, T, D)
    for j, (kv, ln) in enumerate(zip(kvs, lens, strict=True)):
        pad[:, j, :, :ln].copy_(kv[:, :, :ln])
        if ln < T:
            pad[:, j, :, ln:].zero_()  # stale scratch never reaches a result
    k = pad[0].view(n * Hk, T, D)
    v = pad[1].view(n * Hk, T, D)
    qg = q.to(dt).reshape(n * Hk, G, D)
    s = torch.bmm(qg, k.transpose(1, 2)).view(n, Hk, G, T).float().mul_(scale)
    if min(lens) < T:
        ln_t = torch.tensor(lens).view(n, 1, 1, 1)
        s.masked_fill_(torch.arange(T) >= ln_t, float("-inf"))
    p = torch.softmax(s, dim=-1).to(dt).view(n * Hk, G, T)
    return torch.bmm(p, v).view(n, H, D).to(q.dtype)


def attend_rows(
    kvs: list[torch.Tensor], lens: list[int], q: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """Attention of each row, written into out (n, H * D) in row order: fp32 KV one SDPA call
    per row (its per-call cost is lower than copying twice the bytes into a padded batch,
    measured), other dtypes `attend_padded` per length group."""
    _, H, D = q.shape
    if kvs and kvs[0].dtype == torch.float32:
        Hk = int(kvs[0].shape[1])
        for j, (kv, ln) in enumerate(zip(kvs, lens, strict=True)):
            o = F.scaled_dot_product_attention(
                q[j].view(1, Hk, H // Hk, D), kv[None, 0, :, :ln], kv[None, 1, :, :ln], scale=scale
            )
            out[j] = o.reshape(H * D)
        return
    for g in groups_by_length(lens):
        o = attend_padded([kvs[j] for j in g], [lens[j] for j in g], q[g], scale)
        out[g] = o.view(len(g), -1)
