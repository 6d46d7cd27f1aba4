"""Helpers the policies call on any `StepModel`: inverse queries and KV-memory capacity."""

from __future__ import annotations

from tidal.perf.api import BatchShape, StepModel
from tidal.perf.catalog import HardwareSpec, ModelSpec


def add_prefill(base: BatchShape, num_tokens: int, cached_tokens: int = 0) -> BatchShape:
    """`base` plus one more prefill chunk of `num_tokens` after `cached_tokens` of context."""
    if num_tokens <= 0:
        return base
    return BatchShape(
        num_prefill_tokens=base.num_prefill_tokens + num_tokens,
        num_prefill_reqs=base.num_prefill_reqs + 1,
        prefill_attn_pairs=base.prefill_attn_pairs + num_tokens * (cached_tokens + num_tokens),
        num_decode_reqs=base.num_decode_reqs,
        decode_context_tokens=base.decode_context_tokens,
        prefill_sq_tokens=base.prefill_sq_tokens + num_tokens * num_tokens,
    )


def max_prefill_tokens(
    model: StepModel,
    budget_s: float,
    base: BatchShape | None = None,
    cached_tokens: int = 0,
    limit: int = 1 << 16,
) -> int:
    """Largest chunk n <= limit with step_s(base + chunk of n) <= budget_s; 0 if none fits.

    HyGen Alg. 1 `get_max_prefill` (§4.2), for any model: binary search, since every model's
    step time grows with the chunk. `budget_s` is the whole step's budget, not the slack.
    """
    base = base or BatchShape()
    if limit <= 0 or model.step_s(add_prefill(base, 1, cached_tokens)) > budget_s:
        return 0
    lo, hi = 1, limit  # invariant: lo fits
    if model.step_s(add_prefill(base, hi, cached_tokens)) <= budget_s:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if model.step_s(add_prefill(base, mid, cached_tokens)) <= budget_s:
            lo = mid
        else:
            hi = mid
    return lo


def kv_bytes_per_token(model: ModelSpec, tp: int = 1) -> float:
    """KV bytes one token holds on each of `tp` GPUs (all layers, K and V)."""
    return model.kv_bytes_per_token(tp)


def kv_capacity_tokens(
    model: ModelSpec, hw: HardwareSpec, tp: int = 1, mem_fraction: float = 0.9
) -> int:
    """Tokens of KV that fit on one instance: (fraction of memory - weights) / KV per token."""
    if not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    free = hw.mem_bytes * mem_fraction - model.weight_bytes(tp)
    return max(0, int(free // model.kv_bytes_per_token(tp)))


def kv_capacity_blocks(
    model: ModelSpec,
    hw: HardwareSpec,
    tp: int = 1,
    block_tokens: int = 16,
    mem_fraction: float = 0.9,
) -> int:
    """KV blocks of `block_tokens` tokens that fit on one instance."""
    return kv_capacity_tokens(model, hw, tp, mem_fraction) // block_tokens
