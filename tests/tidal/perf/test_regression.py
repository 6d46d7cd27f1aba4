from __future__ import annotations

import time

import numpy as np
import pytest

from tidal.perf.api import BatchShape
from tidal.perf.helpers import max_prefill_tokens
from tidal.perf.regression import RegressionModel, fit_regression

TRUE = (0.01, 5e-5, 4e-7, 4e-9, 1e-14, 3e-4, 6e-5)


def _sample(rng: np.random.Generator, k: int) -> tuple[np.ndarray, ...]:
    sp = rng.integers(0, 2048, k).astype(float)
    sd = rng.integers(0, 200_000, k).astype(float)
    n_p = np.where(sp > 0, rng.integers(1, 5, k), 0).astype(float)
    n_d = rng.integers(0, 256, k).astype(float)
    return sp, sd, n_p, n_d


def test_prediction_hand_worked() -> None:
    m = RegressionModel(TRUE)
    b = BatchShape(num_prefill_tokens=100, num_prefill_reqs=1, num_decode_reqs=10,
                   decode_context_tokens=1000)  # fmt: skip
    # .01 + 5e-5·100 + 4e-7·1000 + 4e-9·100² + 1e-14·1000² + 3e-4·1 + 6e-5·10
    # = .01 + .005 + .0004 + .00004 + .00000001 + .0003 + .0006 = .01634001
    assert m.step_s(b) == pytest.approx(0.01634001)
    assert m.step_s(BatchShape()) == 0.0


def test_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    sp, sd, n_p, n_d = _sample(rng, 2000)
    y = RegressionModel(TRUE).predict(sp, sd, n_p, n_d)
    fit = fit_regression(sp, sd, n_p, n_d, y)
    assert fit.coef == pytest.approx(TRUE, rel=1e-5, abs=1e-18)


def test_fit_with_noise_predicts_within_noise() -> None:
    rng = np.random.default_rng(1)
    sp, sd, n_p, n_d = _sample(rng, 20_000)
    y = RegressionModel(TRUE).predict(sp, sd, n_p, n_d) * np.exp(rng.normal(0, 0.01, 20_000))
    fit = fit_regression(sp[:16_000], sd[:16_000], n_p[:16_000], n_d[:16_000], y[:16_000])
    p = fit.predict(sp[16_000:], sd[16_000:], n_p[16_000:], n_d[16_000:])
    err = np.mean(np.abs(p / y[16_000:] - 1))
    assert err < 0.01  # 1 % lognormal noise has a mean absolute error of about 0.8 %


@pytest.mark.parametrize("budget", [0.012, 0.02, 0.05, 0.2])
@pytest.mark.parametrize("new_request", [True, False])
def test_closed_form_inverse_matches_forward_and_bisection(
    budget: float, new_request: bool
) -> None:
    m = RegressionModel(TRUE)
    base = BatchShape(num_prefill_tokens=64, num_prefill_reqs=1, num_decode_reqs=20,
                      decode_context_tokens=20_000)  # fmt: skip
    n = m.max_prefill_tokens(budget, base, new_request=new_request)
    if n > 0:
        assert m._with(base, n, new_request) <= budget
    assert m._with(base, n + 1, new_request) > budget
    if new_request:  # the generic bisection (one more request per chunk) agrees
        assert n == max_prefill_tokens(m, budget, base, limit=1 << 20)


def test_fit_cost_is_small() -> None:
    # not a timed assertion of the target (see `tidal bench perf-cost`): only that the fit is a
    # single least-squares solve, far below a second on 80k rows even on a busy machine
    rng = np.random.default_rng(2)
    sp, sd, n_p, n_d = _sample(rng, 80_000)
    y = RegressionModel(TRUE).predict(sp, sd, n_p, n_d)
    t0 = time.perf_counter()
    fit_regression(sp, sd, n_p, n_d, y)
    assert time.perf_counter() - t0 < 2.0


def test_rejects_wrong_length() -> None:
    with pytest.raises(ValueError):
        RegressionModel((1.0, 2.0))
