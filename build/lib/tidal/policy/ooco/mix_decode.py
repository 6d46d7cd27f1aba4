"""OOCO Alg. 2 — mix decoding selection on a latency-strict instance (papers/ooco.md §3.4.4).

All online decodes go in first; then up to K offline requests tried in random order (against
starvation); then the untested offline requests sorted by ascending length and the largest prefix
that keeps the step under the TPOT SLO, found by binary search (shortest first maximises the batch
size when only part fits). When the online requests alone already exceed the SLO the configured
overload mode applies (§3.4.4, last paragraph).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import attrgetter

from tidal.perf.api import BatchShape, StepModel
from tidal.policy.batch_shape import add_decode, largest_fit
from tidal.policy.ooco.config import OverloadMode


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    req_id: Hashable
    context_tokens: int  # KV length this step attends over (prompt + generated so far)


_CTX = attrgetter("context_tokens")
_HUGE = 1 << 62  # sort key that puts already-probed requests after every real length


@dataclass(frozen=True)
class MixDecodeSelection:
    """What Alg. 2 decided for one decode step."""

    online: list[Hashable] = field(default_factory=list)  # online req_ids decoded this step
    offline: list[Hashable] = field(default_factory=list)  # offline req_ids decoded this step
    sacrificed: list[Hashable] = field(default_factory=list)  # online req_ids skipped (sacrifice)
    step_s: float = 0.0  # predicted latency of the selected batch, seconds
    online_over_slo: bool = False  # online alone exceeded S (overload mode applied)


def largest_fitting_prefix(
    model: StepModel, base: BatchShape, sorted_ctx: Sequence[int], slo_s: float
) -> tuple[int, float]:
    """Largest k with L(base ∪ first k of sorted_ctx) <= slo_s, by binary search over prefix sums.

    Returns (k, latency of base ∪ prefix). Requires latency monotone in added requests.
    """
    prefix = list(accumulate(sorted_ctx, initial=0))
    # Same answer as a plain binary search over k (latency is monotone in added requests), in
    # fewer model calls: see `largest_fit`.
    return largest_fit(
        lambda k: model.step_s(add_decode(base, k, prefix[k])), len(sorted_ctx), slo_s, prefix
    )


def select_mix_decode(
    model: StepModel,
    online: Sequence[DecodeCandidate],
    offline: Sequence[DecodeCandidate],
    slo_s: float,
    num_probes: int,
    rng: random.Random,
    overload_mode: OverloadMode = "best-effort",
    base: BatchShape | None = None,
) -> MixDecodeSelection:
    """OOCO Alg. 2. `base` is any work already fixed in this step (default: nothing)."""
    shape = base if base is not None else BatchShape()
    # Alg. 2 line 1: B <- R_on.
    on_ctx = sum(map(_CTX, online))
    shape_on = add_decode(shape, len(online), on_ctx)
    lat = model.step_s(shape_on)
    chosen_on = [r.req_id for r in online]
    sacrificed: list[Hashable] = []
    if lat > slo_s:
        if overload_mode == "best-effort":
            # §3.4.4: ignore the SLO and decode every online request; no offline this step.
            return MixDecodeSelection(online=chosen_on, step_s=lat, online_over_slo=True)
        # Sacrifice: keep the most online requests (shortest first) that fit under S.
        by_len = sorted(online, key=lambda r: r.context_tokens)
        k, lat = largest_fitting_prefix(model, shape, [r.context_tokens for r in by_len], slo_s)
        chosen_on = [r.req_id for r in by_len[:k]]
        sacrificed = [r.req_id for r in by_len[k:]]
        shape = add_decode(shape, k, sum(r.context_tokens for r in by_len[:k]))
        return MixDecodeSelection(
            online=chosen_on, sacrificed=sacrificed, step_s=lat, online_over_slo=True
        )
    shape = shape_on
    # Alg. 2 lines 2-9: up to K random probes; each kept if it still fits, else discarded.
    chosen_off: list[Hashable] = []
    n_probe = min(num_probes, len(offline))
    probe_idx = rng.sample(range(len(offline)), n_probe) if n_probe else []
    tested = set(probe_idx)
    # NOTE: when all K probes fit together each fits on its own in any order (monotone
    # latency), so one model call decides them all; otherwise Alg. 2's one-by-one test.
    if n_probe:
        probe_ctx = sum(offline[i].context_tokens for i in probe_idx)
        cand = add_decode(shape, n_probe, probe_ctx)
        cand_lat = model.step_s(cand)
        if cand_lat <= slo_s:
            shape, lat = cand, cand_lat
            chosen_off = [offline[i].req_id for i in probe_idx]
            probe_idx = []
    for i in probe_idx:
        r = offline[i]
        cand = add_decode(shape, 1, r.context_tokens)
        cand_lat = model.step_s(cand)
        if cand_lat <= slo_s:
            shape, lat = cand, cand_lat
            chosen_off.append(r.req_id)
    # Alg. 2 lines 10-14: sorted binary search over the untested remainder.
    if len(tested) < len(offline) and lat < slo_s:
        ctx = list(map(_CTX, offline))
        key = ctx
        if tested:  # tested ones sort last (stable: ties keep index order) and are cut off
            key = ctx.copy()
            for i in tested:
                key[i] = _HUGE
        rest = sorted(range(len(offline)), key=key.__getitem__)[: len(offline) - len(tested)]
        k, lat = largest_fitting_prefix(model, shape, list(map(ctx.__getitem__, rest)), slo_s)
        chosen_off.extend(offline[i].req_id for i in rest[:k])
    return MixDecodeSelection(online=chosen_on, offline=chosen_off, step_s=lat)
