"""OOCO eviction of offline decodes on a latency-strict instance (papers/ooco.md §3.4.1)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from tidal.policy.ooco.mix_decode import DecodeCandidate


def is_compute_bound(decode_batch_size: int, saturation_batch_size: int) -> bool:
    """§3.3.3: decode GEMMs turn compute-bound once the batch reaches the saturation size."""
    return decode_batch_size >= saturation_batch_size


def choose_victims(
    needed_tokens: int, offline: Sequence[DecodeCandidate], compute_bound: bool
) -> list[Hashable] | None:
    """§3.4.1: offline decodes to evict so that `needed_tokens` of KV become free.

    Compute-bound node: evict the longest first (few victims keep the batch large). Otherwise
    evict the shortest first (less to recompute; batch size matters less while memory-bound).
    Returns None when even evicting every offline request frees too little.
    """
    if needed_tokens <= 0:
        return []
    order = sorted(offline, key=lambda r: r.context_tokens, reverse=compute_bound)
    freed, victims = 0, []
    for r in order:
        if freed >= needed_tokens:
            break
        victims.append(r.req_id)
        freed += r.context_tokens
    return victims if freed >= needed_tokens else None
