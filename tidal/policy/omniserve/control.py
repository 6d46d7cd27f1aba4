"""OmniServe Online Scheduler controls (papers/omniserve.md §3.3.3–3.3.6), over BatchShapes.

Per-layer bounds of the paper, f(...) <= S/d − γ, are whole-step bounds step_s <= S − d·γ here.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.perf.api import BatchShape, StepModel
from tidal.policy.batch_shape import add_decode, add_prefill
from tidal.policy.state import ReqState


def admit_ls(
    model: StepModel,
    pending_prefill: Sequence[tuple[int, int]],
    decode: BatchShape,
    new_prompt_tokens: int,
    ttft_slo_s: float,
    step_bound_overhead_s: float = 0.0,
    chunk_size: int = 0,
) -> bool:
    """§3.3.3 admission inequality: admit LS request k iff prefilling every incomplete LS prompt
    (P(t) ∪ k, as (prompt, already-prefilled) pairs) beside the LS decodes fits the TTFT SLO —
    the explicit TTFT of k when it queues behind P(t). Otherwise reject early.

    The paper writes that prefill as one step L(·). With `chunk_size` > 0 it is costed as the
    chunked steps an instance with that chunk size runs (each beside the decodes, each paying
    the step's fixed cost): where the fixed cost is large against a chunk, one L(·) admits
    requests whose TTFT then misses the SLO by the fixed cost of every further chunk."""
    bound = ttft_slo_s - step_bound_overhead_s
    if chunk_size <= 0:
        shape = decode
        for prompt, done in pending_prefill:
            shape = add_prefill(shape, prompt - done, done)
        shape = add_prefill(shape, new_prompt_tokens, 0)
        return model.step_s(shape) <= bound
    total = 0.0
    for prompt, done in [*pending_prefill, (new_prompt_tokens, 0)]:
        while done < prompt:  # FCFS, one chunk a step (`PlanBuilder`'s order)
            q = min(chunk_size, prompt - done)
            total += model.step_s(add_prefill(decode, q, done))
            if total > bound:
                return False
            done += q
    return total <= bound


def max_chunk(
    model: StepModel, shape: BatchShape, left: int, cached: int, bound_s: float, cap: int
) -> int:
    """§3.3.4 chunk-prefill control: max q <= min(left, cap) with L(shape + chunk q) <= bound,
    by binary search (latency is monotone in q)."""
    lo, hi = 0, min(left, cap)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.step_s(add_prefill(shape, mid, cached)) <= bound_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_decodes(
    model: StepModel, shape: BatchShape, contexts: Sequence[int], bound_s: float
) -> int:
    """§3.3.5 BE decoding control: how many of these BE decodes (FCFS) join the GPU batch while
    L <= bound; c_DA += l_j and n += 1 per request. Stops at the first that does not fit, found
    by binary search over prefix sums (latency is monotone in added decodes)."""
    prefix = [0]
    for c in contexts:
        prefix.append(prefix[-1] + c)
    lo, hi = 0, len(contexts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.step_s(add_decode(shape, mid, prefix[mid])) <= bound_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def piggyback_admission(
    model: StepModel, shape: BatchShape, ready_per_layer: Sequence[int], bound_s: float
) -> list[int]:
    """§3.3.6 layer-wise piggyback control: greedily admit CPU-attention results from the lowest
    layer up. Piggybacking a_l requests at layer l adds a_l tokens to that layer's dense GEMMs,
    costing (L(shape + a_l tokens) − L(shape)) / d; admission stops when the step would exceed
    the bound. Returns a_l per layer."""
    d = len(ready_per_layer)
    base = model.step_s(shape)
    slack = bound_s - base
    out = [0] * d
    for layer, ready in enumerate(ready_per_layer):
        if slack <= 0 or ready <= 0:
            continue
        lo, hi = 0, ready
        while lo < hi:
            mid = (lo + hi + 1) // 2
            extra = (model.step_s(add_decode(shape, mid, 0)) - base) / d
            if extra <= slack:
                lo = mid
            else:
                hi = mid - 1
        out[layer] = lo
        if lo:
            slack -= (model.step_s(add_decode(shape, lo, 0)) - base) / d
    return out


def oldest_first(offloaded: Sequence[ReqState], n: int) -> tuple[str, ...]:
    """The `n` offloaded requests to piggyback this step (§3.3.6): those whose last token is
    oldest, so no CPU decode waits behind newer ones."""
    order = sorted(offloaded, key=lambda r: r.last_token_s or 0.0)
    return tuple(r.req_id for r in order[:n])
