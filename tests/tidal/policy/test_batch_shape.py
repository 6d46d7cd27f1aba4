"""`largest_fit`: the interpolation-guided search returns exactly what bisection returns."""

from __future__ import annotations

import random
from itertools import accumulate

from hypothesis import given
from hypothesis import strategies as st

from tidal.perf.linear import LinearStepModel
from tidal.policy.batch_shape import add_decode, decode_shape, largest_fit
from tidal.policy.ooco.mix_decode import largest_fitting_prefix
from tidal.policy.taichi.routing import PrefillTarget, estimate_prefill_s, route_prefill


def _brute(vals: list[float], limit: float) -> int:
    k = 0
    for i, v in enumerate(vals):
        if v <= limit:
            k = i
    return k if vals[0] <= limit else 0


@given(
    st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=60),
    st.floats(-1.0, 400.0, allow_nan=False),
    st.booleans(),
)
def test_largest_fit_matches_brute_force(steps: list[float], limit: float, use_x: bool) -> None:
    vals = list(accumulate(steps))  # non-decreasing f(0..n)
    n = len(vals) - 1
    calls: list[int] = []

    def f(k: int) -> float:
        calls.append(k)
        return vals[k]

    x = list(range(0, 3 * (n + 1), 3)) if use_x else None
    k, fk = largest_fit(f, n, limit, x)
    assert k == _brute(vals, limit)
    assert fk == vals[k]
    assert all(0 <= c <= n for c in calls)


def test_largest_fit_few_calls_on_near_linear_latency() -> None:
    m = LinearStepModel()
    ctx = sorted(random.Random(3).randint(200, 4000) for _ in range(200))
    prefix = list(accumulate(ctx, initial=0))
    base = decode_shape([1000] * 64)
    limit = m.step_s(add_decode(base, 150, prefix[150])) + 1e-9
    calls: list[int] = []

    def f(k: int) -> float:
        calls.append(k)
        return m.step_s(add_decode(base, k, prefix[k]))

    k, _ = largest_fit(f, len(ctx), limit, prefix)
    assert k == 150
    assert len(calls) <= 5  # bisection needs 1 + 8 here
    # The OOCO Alg. 2 helper answers the same.
    assert largest_fitting_prefix(m, base, ctx, limit)[0] == 150


def test_route_prefill_is_the_least_loaded_feasible_instance() -> None:
    m = LinearStepModel()
    idle = decode_shape([])
    rng = random.Random(5)
    for _ in range(200):
        targets = [
            PrefillTarget(
                i,
                rng.random() < 0.5,
                rng.choice([128, 512, 1024]),
                [rng.randint(1, 3000) for _ in range(rng.randint(0, 6))],
                idle,
                m,
            )
            for i in range(4)
        ]
        prompt, slo, xfer = rng.randint(1, 4000), rng.uniform(0.05, 2.0), rng.uniform(0, 0.2)
        feasible = []
        for t in targets:
            q = sum(estimate_prefill_s(m, n, t.chunk_tokens, idle) for n in t.queued_tokens)
            e = estimate_prefill_s(m, prompt, t.chunk_tokens, idle)
            if q + e + (xfer if t.is_p_heavy else 0.0) < slo:
                feasible.append((sum(t.queued_tokens), t.instance_id))
        want = min(feasible)[1] if feasible else None
        assert route_prefill(prompt, targets, slo, xfer) == want
