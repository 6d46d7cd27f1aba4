"""HyGen's SLO-aware profiler (papers/hygen.md §4.2): binary-search the largest per-step latency
budget whose test run still meets the overall SLO. The test run itself (a simulation or a real
replay) is injected, so this stays pure."""

from __future__ import annotations

from collections.abc import Callable


def profile_latency_budget(
    meets_slo: Callable[[float], bool], lo_s: float, hi_s: float, iterations: int = 12
) -> float | None:
    """Largest budget in [lo_s, hi_s] (to within (hi-lo)/2^iterations) for which
    `meets_slo(budget)` holds, assuming compliance is monotone (a larger budget admits more
    offline work). None when even `lo_s` violates the SLO."""
    if not 0 < lo_s <= hi_s:
        raise ValueError("need 0 < lo_s <= hi_s")
    if not meets_slo(lo_s):
        return None
    if meets_slo(hi_s):
        return hi_s
    for _ in range(iterations):
        mid = (lo_s + hi_s) / 2
        if meets_slo(mid):
            lo_s = mid
        else:
            hi_s = mid
    return lo_s
