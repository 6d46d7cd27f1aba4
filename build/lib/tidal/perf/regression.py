"""HyGen's batch-latency predictor (papers/hygen.md §4.2, Eq. 1).

    T_batch = c0 + c1·S_p + c2·S_d + c3·S_p² + c4·S_d² + c5·N_p + c6·N_d

fitted by ordinary least squares on a step log. S_p = prefill tokens in the step, N_p / N_d =
prefill / decode requests. NOTE: S_d is read as the decode requests' total *context* (KV tokens
attended), not their new tokens: with one new token per decode request S_d would equal N_d, the
two columns would be collinear and the KV-read cost of decode (HyGen: "decode ... scaling
proportionally with the number of tokens") would have no feature to land on.

`max_prefill_tokens` is HyGen's `get_max_prefill`: the inverse of the fit in closed form.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tidal.perf.api import BatchShape

FEATURES = ("1", "S_p", "S_d", "S_p^2", "S_d^2", "N_p", "N_d")


def design_matrix(
    s_p: npt.ArrayLike, s_d: npt.ArrayLike, n_p: npt.ArrayLike, n_d: npt.ArrayLike
) -> npt.NDArray[np.float64]:
    """Rows of Eq. 1's features (with an intercept column first), one per step."""
    sp, sd = np.asarray(s_p, dtype=np.float64), np.asarray(s_d, dtype=np.float64)
    npr, nd = np.asarray(n_p, dtype=np.float64), np.asarray(n_d, dtype=np.float64)
    return np.stack([np.ones_like(sp), sp, sd, sp * sp, sd * sd, npr, nd], axis=1)


@dataclass(frozen=True, slots=True)
class RegressionModel:
    """A `StepModel` from seven coefficients (seconds per unit of each feature in FEATURES)."""

    coef: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"need {len(FEATURES)} coefficients {FEATURES}, got {len(self.coef)}")
        if not all(math.isfinite(c) for c in self.coef):
            raise ValueError("coefficients must be finite")

    def step_s(self, batch: BatchShape) -> float:
        if batch.num_prefill_tokens <= 0 and batch.num_decode_reqs <= 0:
            return 0.0
        c0, c1, c2, c3, c4, c5, c6 = self.coef
        sp = batch.num_prefill_tokens
        sd = batch.decode_context_tokens
        t = (
            c0
            + sp * (c1 + c3 * sp)
            + sd * (c2 + c4 * sd)
            + c5 * batch.num_prefill_reqs
            + c6 * batch.num_decode_reqs
        )
        return t if t > 0.0 else 0.0

    def predict(
        self,
        s_p: npt.ArrayLike,
        s_d: npt.ArrayLike,
        n_p: npt.ArrayLike,
        n_d: npt.ArrayLike,
    ) -> npt.NDArray[np.float64]:
        """Vectorised prediction for many steps (seconds)."""
        return design_matrix(s_p, s_d, n_p, n_d) @ np.asarray(self.coef)

    def max_prefill_tokens(
        self, budget_s: float, base: BatchShape | None = None, new_request: bool = True
    ) -> int:
        """HyGen `get_max_prefill`: the largest chunk l with T(base + l prefill tokens) <= budget.

        Solves c3·l² + (c1 + 2·c3·S_p)·l + (T(base') - budget) <= 0 for integer l >= 0, where
        base' is `base` with one more prefill request when `new_request`.
        """
        base = base or BatchShape()
        c0, c1, c2, c3, c4, c5, c6 = self.coef
        sp, sd = base.num_prefill_tokens, base.decode_context_tokens
        n_p = base.num_prefill_reqs + (1 if new_request else 0)
        t0 = c0 + c1 * sp + c3 * sp * sp + c2 * sd + c4 * sd * sd + c5 * n_p
        t0 += c6 * base.num_decode_reqs
        a, b, c = c3, c1 + 2 * c3 * sp, t0 - budget_s
        if a > 1e-30:
            disc = b * b - 4 * a * c
            if disc < 0:
                return 0
            root = (-b + math.sqrt(disc)) / (2 * a)
        elif b > 0:
            root = -c / b
        else:  # time does not grow with tokens: anything fits if the base does
            return (1 << 30) if c <= 0 else 0
        n = max(0, math.floor(root + 1e-9))
        # guard the float edge: the forward model is the authority
        while n > 0 and self._with(base, n, new_request) > budget_s:
            n -= 1
        return n

    def _with(self, base: BatchShape, n: int, new_request: bool) -> float:
        b = dataclasses.replace(
            base,
            num_prefill_tokens=base.num_prefill_tokens + n,
            num_prefill_reqs=base.num_prefill_reqs + (1 if new_request else 0),
        )
        return self.step_s(b)


def fit_regression(
    s_p: npt.ArrayLike,
    s_d: npt.ArrayLike,
    n_p: npt.ArrayLike,
    n_d: npt.ArrayLike,
    step_s: npt.ArrayLike,
    relative: bool = True,
) -> RegressionModel:
    """Least-squares fit of Eq. 1. `relative` weights each row by 1/step_s, so the fit minimises
    relative error (what MAPE measures) instead of letting the longest steps dominate."""
    y = np.asarray(step_s, dtype=np.float64)
    k = y.shape[0]
    if k < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {k}")
    w = 1.0 / np.maximum(y, 1e-12) if relative else np.ones(k)
    sp, sd = np.asarray(s_p, dtype=np.float64), np.asarray(s_d, dtype=np.float64)
    # One contiguous row per feature (the transpose of `design_matrix`), already weighted: every
    # pass below then streams memory once, which keeps 80k samples well under HyGen's ~15 ms.
    xt = np.empty((len(FEATURES), k))
    xt[0] = w
    np.multiply(sp, w, out=xt[1])
    np.multiply(sd, w, out=xt[2])
    np.multiply(xt[1], sp, out=xt[3])
    np.multiply(xt[2], sd, out=xt[4])
    np.multiply(np.asarray(n_p, dtype=np.float64), w, out=xt[5])
    np.multiply(np.asarray(n_d, dtype=np.float64), w, out=xt[6])
    yw = y * w
    # Columns span ~1 .. 1e10 (S_d^2): scale them so the solve is well conditioned.
    scale = np.abs(xt).max(axis=1)
    scale[scale == 0] = 1.0
    xt /= scale[:, None]
    gram = xt @ xt.T  # 7x7 normal equations
    try:
        coef = np.linalg.solve(gram, xt @ yw)
        if not np.all(np.isfinite(coef)) or np.linalg.cond(gram) > 1e12:
            raise np.linalg.LinAlgError("ill-conditioned")
    except np.linalg.LinAlgError:  # nearly collinear columns: SVD least squares
        coef, *_ = np.linalg.lstsq(xt.T, yw, rcond=None)
    return RegressionModel(tuple(float(c) for c in coef / scale))
