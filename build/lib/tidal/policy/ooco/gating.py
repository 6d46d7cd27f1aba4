"""OOCO offline request gating (papers/ooco.md §3.4.2).

A latency-relaxed instance with no online prefill waiting can prefill a new offline request (a
bigger offline decode batch later) or keep decoding. The paper states the rule — prefill only if
the effective latency reduction from the larger decode batch exceeds the expected recompute
overhead of a later eviction — but not the formulas. Our formalisation, all in seconds:

* gain = o * max(0, L(B)/|B| - (L(B ∪ r) - L(B))): each of the request's o decode steps costs the
  marginal step time instead of the batch's average per-token time.
* p_evict = min(1, online_kv_rate * residency / free_after): the chance that online KV demand
  arriving while r is resident (residency = o * L(B ∪ r)) overruns the free KV left after r.
* recompute = L(prefill of p + o/2 tokens): on eviction the prompt and, on average, half the
  output must be recomputed.

Admit iff gain > p_evict * recompute. An empty decode batch always admits (idling gains nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.perf.api import BatchShape, StepModel
from tidal.policy.batch_shape import add_decode, add_prefill


@dataclass(frozen=True, slots=True)
class GatingDecision:
    admit: bool  # prefill the offline request now
    gain_s: float  # predicted decode time saved by the bigger batch, seconds
    expected_recompute_s: float  # p_evict * recompute cost, seconds


def gate_offline_prefill(
    model: StepModel,
    decode_batch: BatchShape,
    prompt_tokens: int,
    expected_output_tokens: int,
    free_kv_tokens: int,
    online_kv_rate_tokens_per_s: float,
) -> GatingDecision:
    """OOCO §3.4.2 cost model (formalised as in the module docstring)."""
    need = prompt_tokens + expected_output_tokens
    if need > free_kv_tokens:
        return GatingDecision(False, 0.0, 0.0)
    if decode_batch.num_decode_reqs == 0:
        return GatingDecision(True, 0.0, 0.0)
    base_s = model.step_s(decode_batch)
    with_r = model.step_s(add_decode(decode_batch, 1, prompt_tokens + expected_output_tokens // 2))
    avg_s = base_s / decode_batch.num_decode_reqs
    gain_s = expected_output_tokens * max(0.0, avg_s - (with_r - base_s))
    residency_s = expected_output_tokens * with_r
    free_after = max(1, free_kv_tokens - need)
    p_evict = min(1.0, max(0.0, online_kv_rate_tokens_per_s) * residency_s / free_after)
    recompute_s = model.step_s(add_prefill(BatchShape(), need - expected_output_tokens // 2, 0))
    expected = p_evict * recompute_s
    return GatingDecision(gain_s > expected, gain_s, expected)
