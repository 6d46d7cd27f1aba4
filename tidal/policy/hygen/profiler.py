"""HyGen's SLO-aware profiler (HyGen §4.2): binary-search the largest per-step latency
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
    return _bisect(meets_slo, lo_s, hi_s, iterations)


def profile_budget_from_above(
    meets_slo: Callable[[float], bool],
    lo_s: float,
    hi_s: float,
    shrink: float = 0.7,
    iterations: int = 5,
) -> float | None:
    """The largest budget in [lo_s, hi_s] whose test run meets the SLO, found from the top:
    `hi_s`, then `hi_s * shrink`, `hi_s * shrink**2`, ... down to the first budget that meets
    it, then `iterations` bisection steps between it and the failing one above.

    §4.2's profiler first "establishes viable latency budget ranges" for the workload and SLO;
    compliance is monotone only inside that range. Below it a TTFT SLO fails again (the
    budget also caps online prefill chunks, so online prompts take more steps, unless
    `online_prefill_budgeted` is off), and `profile_latency_budget`, which starts by testing
    the bottom, would then report nothing.
    Searching down from the top finds the largest compliant budget either way. None when no
    budget down to `lo_s` meets the SLO."""
    if not 0 < lo_s <= hi_s:
        raise ValueError("need 0 < lo_s <= hi_s")
    if not 0 < shrink < 1 or iterations < 0:
        raise ValueError("need 0 < shrink < 1 and iterations >= 0")
    if meets_slo(hi_s):
        return hi_s
    bad, budget = hi_s, hi_s * shrink
    while not meets_slo(budget):
        bad, budget = budget, budget * shrink
        if budget < lo_s:
            return None
    return _bisect(meets_slo, budget, bad, iterations)


def _bisect(meets_slo: Callable[[float], bool], good: float, bad: float, iterations: int) -> float:
    """`iterations` bisection steps on the bracket [good, bad], `good` a budget that meets the
    SLO and `bad` one that does not: the last budget found to meet it (within
    |bad - good| / 2^iterations of the boundary, compliance assumed monotone in the bracket)."""
    for _ in range(iterations):
        mid = (good + bad) / 2
        if meets_slo(mid):
            good = mid
        else:
            bad = mid
    return good
