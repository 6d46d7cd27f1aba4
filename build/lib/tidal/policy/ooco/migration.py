"""OOCO migration (papers/ooco.md §3.4.3): push of online requests after prefill, pull of offline
decodes by latency-strict instances with a length preference (Alg. 1)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tidal.perf.api import BatchShape, StepModel
from tidal.policy.batch_shape import add_decode
from tidal.policy.ooco.eviction import choose_victims, is_compute_bound
from tidal.policy.ooco.mix_decode import DecodeCandidate


class PrefKind(StrEnum):
    LONGEST_FIT = "longest-fit"  # Alg. 1 line 5: compute-saturated, fill memory capacity
    SATURATE = "saturate"  # Alg. 1 line 8: a group can reach saturation; longest length allowed
    SHORTEST = "shortest"  # Alg. 1 line 10: maximise the batch size


@dataclass(frozen=True, slots=True)
class LengthPreference:
    kind: PrefKind
    target_tokens: int  # preferred KV length of pulled offline requests, tokens
    group_size: int  # how many requests the preference was computed for (1 unless SATURATE)


def _max_len(
    model: StepModel, batch: BatchShape, count: int, slo_s: float, lo: int, hi: int
) -> int | None:
    """Largest ℓ in [lo, hi] with L(B ∪ count×ℓ) <= S, or None (latency monotone in ℓ)."""
    if hi < lo or model.step_s(add_decode(batch, count, count * lo)) > slo_s:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.step_s(add_decode(batch, count, count * mid)) <= slo_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def length_preference(
    model: StepModel,
    batch: BatchShape,
    all_included: bool,
    slo_s: float,
    margin: float,
    saturation_batch_size: int,
    free_kv_tokens: int,
    shortest_tokens: int,
    max_request_tokens: int,
) -> LengthPreference | None:
    """OOCO Alg. 1: the length preference a strict instance sends with its pull, or None.

    `batch` is the decode batch chosen by the previous mix-decoding selection (line 1),
    `all_included` whether it held every request resident on the node, `shortest_tokens` the
    shortest length an offline candidate can have (min{ℓ}).
    """
    # Line 2: pull only when the whole node fits with margin under the SLO.
    if not all_included or model.step_s(batch) >= margin * slo_s:
        return None
    bs = batch.num_decode_reqs
    cap = min(max_request_tokens, free_kv_tokens)
    if cap < 1:
        return None
    # Lines 3-4: bottleneck type.
    if is_compute_bound(bs, saturation_batch_size):
        # Line 5: compute-saturated -> longest request within SLO and memory capacity.
        best = _max_len(model, batch, 1, slo_s, max(1, shortest_tokens), cap)
        return None if best is None else LengthPreference(PrefKind.LONGEST_FIT, best, 1)
    need = saturation_batch_size - bs
    per_req_cap = cap // need
    # Line 7: can some group reach saturation within the SLO (shortest lengths are the best case)?
    if per_req_cap >= max(1, shortest_tokens):
        best = _max_len(model, batch, need, slo_s, max(1, shortest_tokens), per_req_cap)
        if best is not None:
            return LengthPreference(PrefKind.SATURATE, best, need)  # line 8
    # Line 10: otherwise prefer the shortest requests to maximise batch size.
    if model.step_s(add_decode(batch, 1, shortest_tokens)) > slo_s:
        return None
    return LengthPreference(PrefKind.SHORTEST, max(1, shortest_tokens), 1)


def select_for_pull(
    model: StepModel,
    pref: LengthPreference,
    candidates: Sequence[DecodeCandidate],
    strict_batch: BatchShape,
    slo_s: float,
    free_kv_tokens: int,
    max_count: int,
) -> list[Hashable]:
    """Alg. 1 line 14: the relaxed instance picks its ongoing offline decodes closest to the
    preference and migrates as many as the strict instance's SLO and KV space admit."""
    order = sorted(
        candidates, key=lambda r: (abs(r.context_tokens - pref.target_tokens), r.context_tokens)
    )
    chosen: list[Hashable] = []
    shape, free = strict_batch, free_kv_tokens
    for r in order:
        if len(chosen) >= max_count:
            break
        if r.context_tokens > free:
            continue
        cand = add_decode(shape, 1, r.context_tokens)
        if model.step_s(cand) > slo_s:
            continue
        shape, free = cand, free - r.context_tokens
        chosen.append(r.req_id)
    return chosen


@dataclass(frozen=True, slots=True)
class StrictView:
    """What a relaxed instance knows about a strict instance when it pushes (§3.4.3)."""

    instance_id: Hashable
    free_kv_tokens: int  # KV tokens free right now
    offline: Sequence[DecodeCandidate] = ()  # its offline decodes (evictable)
    num_decode_reqs: int = 0  # current decode batch size (for the bottleneck)


@dataclass(frozen=True)
class PushDecision:
    instance_id: Hashable  # strict instance that receives the online request
    evict: list[Hashable] = field(default_factory=list)  # offline req_ids it evicts first


def choose_push_target(
    kv_tokens: int, strict: Sequence[StrictView], saturation_batch_size: int
) -> PushDecision | None:
    """§3.4.3 push model: send a prefilled online request to the strict instance with the most free
    KV; if none has room, to the one that frees room by evicting the least offline work (victims
    chosen by bottleneck, §3.4.1). None when no strict instance can host it even after eviction."""
    fits = [s for s in strict if s.free_kv_tokens >= kv_tokens]
    if fits:
        best = max(fits, key=lambda s: s.free_kv_tokens)
        return PushDecision(best.instance_id)
    best_plan: tuple[int, PushDecision] | None = None
    for s in strict:
        need = kv_tokens - s.free_kv_tokens
        victims = choose_victims(
            need, s.offline, is_compute_bound(s.num_decode_reqs, saturation_batch_size)
        )
        if victims is None:
            continue
        lost = sum(r.context_tokens for r in s.offline if r.req_id in set(victims))
        if best_plan is None or lost < best_plan[0]:
            best_plan = (lost, PushDecision(s.instance_id, victims))
    return None if best_plan is None else best_plan[1]
