from __future__ import annotations

import numpy as np

from tidal.workload.arrivals import gamma_arrivals, poisson_arrivals, scale_trace, uniform_arrivals


def test_uniform_is_evenly_spaced() -> None:
    t = uniform_arrivals(4.0, 2.0)
    assert t.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]


def test_poisson_rate_and_window() -> None:
    t = poisson_arrivals(50.0, 200.0, np.random.default_rng(0))
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 200.0
    assert abs(len(t) / 200.0 - 50.0) < 2.0  # 10000 expected, sd 100


def test_gamma_cv_controls_burstiness() -> None:
    rng = np.random.default_rng(1)
    smooth = np.diff(gamma_arrivals(20.0, 0.5, 500.0, rng))
    bursty = np.diff(gamma_arrivals(20.0, 3.0, 500.0, rng))
    assert abs(smooth.std() / smooth.mean() - 0.5) < 0.05
    assert abs(bursty.std() / bursty.mean() - 3.0) < 0.5


def test_scale_down_drops_at_a_fixed_ratio() -> None:
    a = np.arange(10000) * 0.1
    t, rows = scale_trace(a, 0.25, np.random.default_rng(0))
    assert abs(len(t) / 10000 - 0.25) < 0.02
    assert np.array_equal(t, a[rows])


def test_scale_up_keeps_burst_shape() -> None:
    # A trace with a burst: 100 req in [0, 10) then 10 req in [10, 110).
    a = np.concatenate([np.arange(100) * 0.1, 10 + np.arange(10) * 10.0])
    t, rows = scale_trace(a, 3.0, np.random.default_rng(0))
    assert len(t) == 330
    assert np.all(np.diff(t) >= 0)
    burst, calm = np.sum(t < 10), np.sum((t >= 10) & (t < 110))
    assert burst == 300 and calm == 30  # 3x each: peak/trough ratio preserved
    assert set(rows[::3].tolist()) == set(range(110))  # every original request kept


def test_fractional_scale_up() -> None:
    a = np.arange(1000) * 1.0
    t, _ = scale_trace(a, 1.5, np.random.default_rng(0))
    assert 1450 < len(t) < 1550
