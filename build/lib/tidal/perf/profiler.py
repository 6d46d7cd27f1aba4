"""HyGen's SLO-aware profiler (papers/hygen.md §4.2): binary-search the per-step latency budget.

A larger budget lets each step carry more offline work, so online TBT/TTFT grow with the budget;
the profiler finds the largest budget whose chosen SLO metric (mean or P99 of TBT or TTFT) stays
within target on a given workload. The evaluation is pluggable: any callable budget -> metric
(the cluster simulator, once it exists); `QueueEvaluator` is a small single-instance stand-in that
runs HyGen's two-phase batching (online first, then offline within the budget) on a step model.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tidal.perf.api import BatchShape, StepModel
from tidal.perf.helpers import add_prefill, max_prefill_tokens

METRICS = ("mean_tbt", "p99_tbt", "mean_ttft", "p99_ttft")


@dataclass(frozen=True)
class BudgetResult:
    budget_s: float  # largest budget found within target (lo if even that one fails)
    metric: float  # the metric at budget_s
    feasible: bool  # False when even the lowest budget misses the target
    evaluations: tuple[tuple[float, float], ...]  # (budget_s, metric) in the order probed


def find_latency_budget(
    evaluate: Callable[[float], float],
    target: float,
    lo_s: float,
    hi_s: float | None = None,
    rel_tol: float = 0.01,
    max_evals: int = 40,
    max_doublings: int = 10,
) -> BudgetResult:
    """HyGen §4.2: the largest budget in [lo_s, hi_s] with evaluate(budget) <= target.

    Assumes the metric does not fall as the budget grows. Without `hi_s` the range is found by
    doubling from lo_s until the target is missed (the "viable budget range" step), at most
    `max_doublings` times: a metric still within target there means the budget does not bind.
    """
    if lo_s <= 0 or target <= 0:
        raise ValueError("lo_s and target must be > 0")
    evals: list[tuple[float, float]] = []

    def ev(b: float) -> float:
        v = float(evaluate(b))
        evals.append((b, v))
        return v

    v_lo = ev(lo_s)
    if v_lo > target:
        return BudgetResult(lo_s, v_lo, False, tuple(evals))
    if hi_s is None:
        hi_s = lo_s
        while len(evals) < min(max_evals, max_doublings + 1):
            hi_s *= 2
            v = ev(hi_s)
            if v > target:
                break
            lo_s, v_lo = hi_s, v
        else:
            return BudgetResult(lo_s, v_lo, True, tuple(evals))
        if v <= target:
            return BudgetResult(hi_s, v, True, tuple(evals))
    else:
        v_hi = ev(hi_s)
        if v_hi <= target:
            return BudgetResult(hi_s, v_hi, True, tuple(evals))
    while hi_s - lo_s > rel_tol * lo_s and len(evals) < max_evals:
        mid = 0.5 * (lo_s + hi_s)
        v = ev(mid)
        if v <= target:
            lo_s, v_lo = mid, v
        else:
            hi_s = mid
    return BudgetResult(lo_s, v_lo, True, tuple(evals))


@dataclass
class _Req:
    arrival_s: float
    prompt: int
    output: int
    done_prompt: int = 0
    done_output: int = 0
    last_token_s: float = 0.0


@dataclass(frozen=True)
class QueueEvaluator:
    """budget -> online SLO metric, by running HyGen's two-phase batching on one instance whose
    step times come from `model` (emulated; no engine). Offline work is an endless backlog of
    (offline_prompt, offline_output) requests, as in a co-located deployment with a batch job.

    Online arrivals: (arrival_s, prompt_tokens, output_tokens) per request.
    """

    model: StepModel
    online: Sequence[tuple[float, int, int]]
    metric: str = "p99_tbt"
    chunk_tokens: int = 512  # HyGen chunk size c: prefill tokens per step
    kv_capacity_tokens: int = 200_000
    offline_prompt: int = 1024
    offline_output: int = 256
    max_offline: int = 256  # offline requests held at once
    _ttft: list[float] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if self.chunk_tokens < 1 or self.kv_capacity_tokens < 1:
            raise ValueError("chunk_tokens and kv_capacity_tokens must be >= 1")

    def __call__(self, budget_s: float) -> float:
        ttft, tbt, _ = self.run(budget_s)
        xs = ttft if self.metric.endswith("ttft") else tbt
        if not xs:
            return 0.0
        return float(np.mean(xs) if self.metric.startswith("mean") else np.percentile(xs, 99))

    def run(self, budget_s: float) -> tuple[list[float], list[float], int]:
        """Simulate; returns (online TTFTs, online TBTs, offline tokens generated)."""
        step = self.model.step_s
        pending = sorted(self.online)
        arrivals = [_Req(a, p, o) for a, p, o in pending]
        waiting: list[_Req] = []
        running: list[_Req] = []
        off_dec: list[int] = []  # offline decode contexts
        off_left: list[int] = []  # their remaining output tokens
        off_pref = 0  # prompt tokens done of the offline request being prefilled
        ttft: list[float] = []
        tbt: list[float] = []
        off_tokens = 0
        now, i = 0.0, 0
        while i < len(arrivals) or waiting or running:
            while i < len(arrivals) and arrivals[i].arrival_s <= now:
                waiting.append(arrivals[i])
                i += 1
            # Phase 1 (online): every online decode, then online prefill chunks up to c.
            ctx = sum(r.prompt + r.done_output for r in running)
            batch = BatchShape(num_decode_reqs=len(running), decode_context_tokens=ctx)
            chunk, plan = self.chunk_tokens, []
            for r in waiting:
                if chunk <= 0:
                    break
                n = min(chunk, r.prompt - r.done_prompt)
                batch = add_prefill(batch, n, r.done_prompt)
                plan.append((r, n))
                chunk -= n
            kv = ctx + sum(r.done_prompt for r in waiting) + sum(off_dec) + off_pref
            # Phase 2 (offline): decodes, then one offline prefill, while within the budget.
            while off_dec and kv > self.kv_capacity_tokens:  # online first: evict offline
                kv -= off_dec.pop()
                off_left.pop()
            k = min(self._fit_decodes(batch, budget_s), len(off_dec))
            acc = list(itertools.accumulate(off_dec[:k]))
            batch = dataclasses.replace(
                batch,
                num_decode_reqs=batch.num_decode_reqs + k,
                decode_context_tokens=batch.decode_context_tokens + (acc[-1] if acc else 0),
            )
            n_off = 0
            if chunk > 0 and len(off_dec) < self.max_offline:
                lim = min(chunk, self.offline_prompt - off_pref)
                n_off = max_prefill_tokens(self.model, budget_s, batch, off_pref, lim)
                batch = add_prefill(batch, n_off, off_pref)
            if batch.num_tokens == 0:
                if i < len(arrivals):
                    now = max(now, arrivals[i].arrival_s)
                    continue
                break
            now += step(batch)
            for r, n in plan:
                r.done_prompt += n
                if r.done_prompt >= r.prompt:
                    waiting.remove(r)
                    ttft.append(now - r.arrival_s)
                    r.done_output, r.last_token_s = 1, now
                    if r.output > 1:
                        running.append(r)
            for r in list(running):
                if r.last_token_s < now:
                    tbt.append(now - r.last_token_s)
                    r.last_token_s = now
                    r.done_output += 1
                    if r.done_output >= r.output:
                        running.remove(r)
            for j in range(k):
                off_dec[j] += 1
                off_left[j] -= 1
            off_tokens += k
            keep = [j for j in range(len(off_dec)) if off_left[j] > 0]
            off_dec = [off_dec[j] for j in keep]
            off_left = [off_left[j] for j in keep]
            off_pref += n_off
            if off_pref >= self.offline_prompt:
                off_dec.append(self.offline_prompt)
                off_left.append(self.offline_output)
                off_pref = 0
        return ttft, tbt, off_tokens

    def _fit_decodes(self, batch: BatchShape, budget_s: float) -> int:
        """How many offline decodes (at the mean offline context) fit in the budget."""
        ctx = self.offline_prompt + self.offline_output // 2
        step = self.model.step_s

        def t(k: int) -> float:
            return step(
                dataclasses.replace(
                    batch,
                    num_decode_reqs=batch.num_decode_reqs + k,
                    decode_context_tokens=batch.decode_context_tokens + k * ctx,
                )
            )

        lo, hi = 0, self.max_offline
        if t(1) > budget_s:
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if t(mid) <= budget_s:
                lo = mid
            else:
                hi = mid
        return hi if t(hi) <= budget_s else lo
