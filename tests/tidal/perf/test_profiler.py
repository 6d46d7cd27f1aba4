from __future__ import annotations

import numpy as np
import pytest

from tidal.perf.factory import make_step_model
from tidal.perf.profiler import QueueEvaluator, find_latency_budget


def test_binary_search_finds_the_threshold_of_a_monotone_metric() -> None:
    # metric = 2·budget: the largest budget with metric <= 0.1 is 0.05
    res = find_latency_budget(lambda b: 2 * b, target=0.1, lo_s=0.001, rel_tol=1e-4)
    assert res.feasible
    assert res.budget_s == pytest.approx(0.05, rel=1e-3)
    assert res.metric <= 0.1
    assert len(res.evaluations) < 30  # doubling then bisection, not a scan


def test_explicit_range_and_infeasible_target() -> None:
    res = find_latency_budget(lambda b: b + 1.0, target=0.5, lo_s=0.01, hi_s=1.0)
    assert not res.feasible and res.budget_s == 0.01
    res = find_latency_budget(lambda b: b, target=2.0, lo_s=0.01, hi_s=1.0)
    assert res.feasible and res.budget_s == 1.0  # the budget never binds in range


def _online(rate: float = 2.0, k: int = 60) -> list[tuple[float, int, int]]:
    rng = np.random.default_rng(0)
    arr = np.cumsum(rng.exponential(1 / rate, k))
    rows = zip(arr, rng.integers(100, 1500, k), rng.integers(10, 120, k), strict=True)
    return [(float(a), int(p), int(o)) for a, p, o in rows]


def test_queue_evaluator_trades_online_latency_for_offline_throughput() -> None:
    model = make_step_model("llama-2-7b", "a100-80gb")
    ev = QueueEvaluator(model, _online())
    ttft_lo, tbt_lo, off_lo = ev.run(0.03)
    ttft_hi, tbt_hi, off_hi = ev.run(0.12)
    assert len(ttft_lo) == len(ttft_hi) == 60  # every online request served
    assert off_hi > off_lo > 0
    assert np.mean(tbt_hi) > np.mean(tbt_lo)
    assert ev(0.12) >= ev(0.03)  # p99 TBT


def test_profiler_on_the_queue_meets_the_target() -> None:
    model = make_step_model("llama-2-7b", "a100-80gb")
    ev = QueueEvaluator(model, _online(), metric="mean_tbt")
    res = find_latency_budget(ev, target=0.06, lo_s=0.02)
    assert res.feasible
    assert ev(res.budget_s) <= 0.06
    assert ev(res.budget_s * 1.1) > 0.06 or res.budget_s >= 0.02 * 2**10


def test_unknown_metric_is_refused() -> None:
    with pytest.raises(ValueError):
        QueueEvaluator(make_step_model("llama-2-7b", "h100"), [], metric="p50_tbt")
