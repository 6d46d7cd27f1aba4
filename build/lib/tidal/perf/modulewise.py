"""OmniServe's module-wise latency models (papers/omniserve.md §3.3.1), per transformer layer:

    f_PA(c_PA) = a_PA·c_PA + b_PA                      (Eq. 2)  prefill attention
    f_DA(c_DA, g) = a_DA·c_DA + h_DA·g + b_DA          (Eq. 3)  decode attention
    f_D(n)  piecewise-linear table built by Alg. 1     dense (token-wise) modules
    γ_T(n) = α + β·n                                   TP collectives (alpha-beta model)

c_PA = Σ_chunks Σ_{i=l+1}^{l+q} i (causal (query, key) pairs), c_DA = Σ_decode (l_j + 1), g = the
number of decoding requests, n = tokens in the step. A step costs L·(f_PA + f_DA + f_D + γ) plus a
per-step overhead.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.perf.api import BatchShape


def causal_prefill_load(batch: BatchShape) -> float:
    """c_PA from a BatchShape: Σ(q·l + q(q+1)/2) = pairs - Σq²/2 + S_p/2 (pairs = Σ q·(l+q))."""
    if batch.num_prefill_tokens <= 0:
        return 0.0
    sq: float = batch.prefill_sq_tokens
    if sq <= 0:  # unknown: equal chunks
        sq = batch.num_prefill_tokens**2 / max(batch.num_prefill_reqs, 1)
    return batch.prefill_attn_pairs - sq / 2 + batch.num_prefill_tokens / 2


def build_dense_table(
    latency: Callable[[int], float],
    n_min: int = 1,
    n_max: int = 4096,
    threshold: float | None = None,
) -> tuple[tuple[float, float], ...]:
    """OmniServe Alg. 1: interpolation-based divide and conquer over input sizes.

    `latency(n)` measures (or looks up) the dense modules at n tokens. A range whose end points
    differ by at most `threshold` is flat: it is interpolated. Otherwise it is split at the middle
    and both halves recurse, which finds the spikes of tile changes with O(log n) probes per
    spike. Default threshold (as in the paper): |latency(16) - latency(1)|.
    Returns (n, seconds) knots sorted by n.
    """
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
    cache: dict[int, float] = {}

    def lat(n: int) -> float:
        if n not in cache:
            cache[n] = float(latency(n))
        return cache[n]

    if threshold is None:
        threshold = abs(lat(min(16, n_max)) - lat(n_min))
    # NOTE: a zero threshold (flat 1..16) would split down to single tokens; keep 1 % of the
    # smallest latency as the floor of "flat".
    threshold = max(threshold, 0.01 * lat(n_min))
    stack = [(n_min, n_max)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo <= 1 or abs(lat(hi) - lat(lo)) <= threshold:
            lat(lo), lat(hi)
            continue
        mid = (lo + hi) // 2
        lat(mid)
        stack.append((lo, mid))
        stack.append((mid + 1, hi) if mid + 1 < hi else (mid, hi))
    return tuple(sorted(cache.items()))


@dataclass(frozen=True)
class ModuleWiseModel:
    """A `StepModel` from OmniServe's per-layer module models."""

    num_layers: int
    a_pa: float  # s per causal (query, key) pair, per layer
    b_pa: float  # s per layer when any prefill runs
    a_da: float  # s per decode context token, per layer
    h_da: float  # s per decoding request, per layer
    b_da: float  # s per layer when any decode runs
    dense: tuple[tuple[float, float], ...]  # (n tokens, s per layer) knots from Alg. 1
    gamma_alpha: float = 0.0  # s per layer, TP collective latency term
    gamma_beta: float = 0.0  # s per token per layer, TP collective bandwidth term
    step_overhead_s: float = 0.0  # per step (scheduling, sampling, launch)
    _xs: tuple[float, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.dense:
            raise ValueError("dense table must have at least one knot")
        xs = [k[0] for k in self.dense]
        if xs != sorted(xs):
            raise ValueError("dense knots must be sorted by n")
        object.__setattr__(self, "_xs", tuple(xs))  # cached for bisect in f_d

    def f_pa(self, c_pa: float) -> float:
        return self.a_pa * c_pa + self.b_pa

    def f_da(self, c_da: float, g: int) -> float:
        return self.a_da * c_da + self.h_da * g + self.b_da

    def f_d(self, n: float) -> float:
        """Dense modules at n tokens: interpolate the table; extrapolate linearly past its end."""
        d = self.dense
        if len(d) == 1:
            return d[0][1] * n / d[0][0]
        i = bisect.bisect_right(self._xs, n)
        if i == 0:
            return d[0][1]
        i = min(i, len(d) - 1)
        (x0, y0), (x1, y1) = d[i - 1], d[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def gamma(self, n: float) -> float:
        return self.gamma_alpha + self.gamma_beta * n if self.gamma_beta or self.gamma_alpha else 0

    def step_s(self, batch: BatchShape) -> float:
        n = batch.num_prefill_tokens + batch.num_decode_reqs
        if n <= 0:
            return 0.0
        layer = self.f_d(n) + self.gamma(n)
        if batch.num_prefill_tokens:
            layer += self.f_pa(causal_prefill_load(batch))
        if batch.num_decode_reqs:
            g = batch.num_decode_reqs
            layer += self.f_da(batch.decode_context_tokens + g, g)
        return self.num_layers * layer + self.step_overhead_s


def modulewise_to_dict(m: ModuleWiseModel) -> dict[str, Any]:
    d = asdict(m)
    d.pop("_xs", None)
    d["dense"] = [list(k) for k in m.dense]
    return d


def modulewise_from_dict(d: dict[str, Any]) -> ModuleWiseModel:
    d = dict(d)
    d["dense"] = tuple((float(a), float(b)) for a, b in d["dense"])
    return ModuleWiseModel(**d)


# ---- fitting --------------------------------------------------------------------------------


def _hat_basis(
    n: npt.NDArray[np.float64], knots: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """(R, K) piecewise-linear interpolation weights of each n on the knots (linear past ends)."""
    k = len(knots)
    idx = np.clip(np.searchsorted(knots, n, side="right") - 1, 0, k - 2)
    t = (n - knots[idx]) / (knots[idx + 1] - knots[idx])
    t = np.maximum(t, 0.0)  # flat below the first knot, linear extrapolation above the last
    phi = np.zeros((len(n), k))
    rows = np.arange(len(n))
    phi[rows, idx] = 1 - t
    phi[rows, idx + 1] += t
    return phi


def default_dense_knots(n_max: int, tile: int = 64) -> npt.NDArray[np.float64]:
    """Knots for a dense table fitted from steps (no per-size probing possible): powers of two
    up to the tile, then every tile, where GEMM time steps (OmniServe Fig. 8c)."""
    pw = [1.0]
    while pw[-1] * 2 < tile:
        pw.append(pw[-1] * 2)
    grid = np.arange(tile, max(n_max, tile) + tile, tile, dtype=np.float64)
    return np.unique(np.r_[pw, grid])


def fit_modulewise_steps(
    batches: list[BatchShape],
    step_s: npt.ArrayLike,
    num_layers: int,
    knots: npt.ArrayLike | None = None,
    ridge: float = 1e-6,
) -> ModuleWiseModel:
    """Fit f_PA, f_DA and the f_D table jointly to whole-step times (linear least squares,
    relative-error weighted). With only step times the dense modules and the TP collectives both
    depend on n alone, so γ folds into f_D (as OmniServe's profiler does, §3.3.1)."""
    y = np.asarray(step_s, dtype=np.float64)
    n = np.array([b.num_tokens for b in batches], dtype=np.float64)
    kn = (
        np.asarray(knots, dtype=np.float64)
        if knots is not None
        else default_dense_knots(int(n.max()))
    )
    kn = kn[kn <= max(n.max(), kn[1])] if len(kn) > 2 else kn
    has_p = np.array([b.num_prefill_tokens > 0 for b in batches], dtype=np.float64)
    has_d = np.array([b.num_decode_reqs > 0 for b in batches], dtype=np.float64)
    cpa = np.array([causal_prefill_load(b) for b in batches])
    g = np.array([b.num_decode_reqs for b in batches], dtype=np.float64)
    cda = np.array([b.decode_context_tokens for b in batches], dtype=np.float64) + g
    x = np.column_stack([cpa, has_p, cda * has_d, g, has_d, _hat_basis(n, kn)]) * num_layers
    w = 1.0 / np.maximum(y, 1e-12)
    xw, yw = x * w[:, None], y * w
    # A light ridge on neighbouring knots' difference (in units of the typical per-layer dense
    # time) keeps knot intervals that no step falls in well posed.
    k0 = 5
    level = float(np.median(y)) / num_layers
    nk = len(kn)
    reg = np.zeros((nk - 1, x.shape[1]))
    rows = np.arange(nk - 1)
    reg[rows, k0 + rows] = -np.sqrt(ridge) / level
    reg[rows, k0 + rows + 1] = np.sqrt(ridge) / level
    a = np.vstack([xw, reg])
    # columns span many decades (c_PA ~ 1e7, flags ~ 1): scale them for a well-posed solve
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(a / scale, np.r_[yw, np.zeros(nk - 1)], rcond=None)
    coef = coef / scale
    dense = tuple((float(a_), float(b_)) for a_, b_ in zip(kn, coef[k0:], strict=True))
    return ModuleWiseModel(
        num_layers=num_layers,
        a_pa=float(coef[0]),
        b_pa=float(coef[1]),
        a_da=float(coef[2]),
        h_da=float(coef[3]),
        b_da=float(coef[4]),
        dense=dense,
    )
