"""Calibration of the roofline (OOCO §3.3.2: "parameters ... obtained through a small amount of
profiling data") from per-kernel GPU timings or from whole measured steps.

Both fits minimise mean absolute percentage error (what the targets measure) with Nelder-Mead on
log-rates, so no rate can go negative and a few slow outliers do not dominate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from tidal.perf.api import BatchShape
from tidal.perf.catalog import ModelSpec
from tidal.perf.kernel_timings import KernelTimings
from tidal.perf.roofline import RooflineModel, RooflineParams, layer_gemms

TILE_CHOICES = (1, 16, 32, 64, 128)


def nelder_mead(
    f: Callable[[npt.NDArray[np.float64]], float],
    x0: Sequence[float] | npt.NDArray[np.float64],
    step: float = 0.3,
    iters: int = 1500,
    tol: float = 1e-10,
) -> tuple[npt.NDArray[np.float64], float]:
    """Minimise f from x0 (numpy has no optimiser and scipy is not a dependency)."""
    n = len(x0)
    pts = [np.asarray(x0, dtype=np.float64)]
    for i in range(n):
        x = pts[0].copy()
        x[i] += step
        pts.append(x)
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * (abs(vals[0]) + tol):
            break
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                for i in range(1, len(pts)):
                    pts[i] = pts[0] + 0.5 * (pts[i] - pts[0])
                    vals[i] = f(pts[i])
    i = int(np.argmin(vals))
    return pts[i], float(vals[i])


def mape(pred: npt.ArrayLike, actual: npt.ArrayLike) -> float:
    p, a = np.asarray(pred, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    return float(np.mean(np.abs(p / a - 1.0)))


# ---- per-kernel GEMM timings -------------------------------------------------------------


def _gemm_terms(
    model: ModelSpec, num_tokens: npt.NDArray[np.float64], tp: npt.NDArray[np.int64], tile: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(R, 4) FLOPs (token dim tile-rounded) and bytes of each row's four projections."""
    d = float(model.bytes_per_value)
    nq = np.ceil(num_tokens / tile) * tile
    flops = np.zeros((len(num_tokens), 4))
    nbytes = np.zeros_like(flops)
    for t in np.unique(tp):
        m = tp == t
        for j, g in enumerate(layer_gemms(model, int(t))):
            flops[m, j] = 2 * nq[m] * g.din * g.dout  # Table 3: 2·N·Din·Dout
            nbytes[m, j] = d * (num_tokens[m] * (g.din + g.dout) + g.din * g.dout)
    return flops, nbytes


def _kernel_s(
    theta: npt.NDArray[np.float64], flops: npt.NDArray[np.float64], nbytes: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    # theta = (log F_g [TFLOP/s], log M_g [TB/s], O_k [us], log knee); mirrors RooflineModel
    c = flops / (np.exp(theta[0]) * 1e12)
    m = nbytes / (np.exp(theta[1]) * 1e12)
    k = np.exp(theta[3])
    hi = np.maximum(c, m)
    return hi * ((c / hi) ** k + (m / hi) ** k) ** (1.0 / k) + theta[2] * 1e-6


def fit_kernel_roofline(
    kt: KernelTimings,
    base: RooflineParams,
    tiles: Sequence[int] = TILE_CHOICES,
    per_shape_eff: bool = True,
) -> RooflineParams:
    """Fit F_g, M_g, O_k, knee (and the tile, from `tiles`) to measured GEMM kernels; then, if
    `per_shape_eff`, tabulate each measured shape's residual ratio at its token counts.
    Attention, overhead and link parameters are kept from `base` (the CSVs have none)."""
    y = kt.gemm_s()
    best: tuple[float, int, npt.NDArray[np.float64]] | None = None
    for tile in tiles:
        flops, nbytes = _gemm_terms(kt.model, kt.num_tokens, kt.tp, tile)
        x0 = [np.log(base.F_g / 1e12), np.log(base.M_g / 1e12), 5.0, np.log(2.0)]

        def loss(
            th: npt.NDArray[np.float64], f: npt.NDArray = flops, b: npt.NDArray = nbytes
        ) -> float:
            if th[2] < 0 or not -2.5 < th[3] < 4.0:
                return 1e9
            return mape(_kernel_s(th, f, b), y)

        th, val = nelder_mead(loss, x0)
        if best is None or val < best[0] - 1e-4:
            best = (val, tile, th)
    assert best is not None
    _, tile, th = best
    params = dataclasses.replace(
        base,
        F_g=float(np.exp(th[0]) * 1e12),
        M_g=float(np.exp(th[1]) * 1e12),
        O_k=float(th[2] * 1e-6),
        knee=float(np.exp(th[3])),
        tile_tokens=int(tile),
        gemm_eff=(),
    )
    if not per_shape_eff:
        return params
    pred = predict_kernel_gemms(params, kt)
    tables: list[tuple[float, float, tuple[tuple[float, float], ...]]] = []
    for t in np.unique(kt.tp):
        rows = kt.tp == t
        for j, g in enumerate(layer_gemms(kt.model, int(t))):
            ratio = y[rows, j] / pred[rows, j]
            n = kt.num_tokens[rows]
            order = np.argsort(n, kind="stable")
            knots = tuple((float(a), float(b)) for a, b in zip(n[order], ratio[order], strict=True))
            tables.append((float(g.din), float(g.dout), knots))
    return dataclasses.replace(params, gemm_eff=tuple(tables))


def predict_kernel_gemms(params: RooflineParams, kt: KernelTimings) -> npt.NDArray[np.float64]:
    """(R, 4) predicted seconds of each row's projections, by the `RooflineModel` itself."""
    out = np.zeros((kt.num_rows, 4))
    models = {int(t): RooflineModel(kt.model, params, int(t)) for t in np.unique(kt.tp)}
    for r in range(kt.num_rows):
        out[r] = models[int(kt.tp[r])].gemm_s(float(kt.num_tokens[r]))
    return out


# ---- whole steps ----------------------------------------------------------------------------

_STEP_FIELDS = ("F_g", "F_ap", "F_ad", "M_g", "M_a")


def fit_step_roofline(
    model: ModelSpec,
    tp: int,
    batches: Sequence[BatchShape],
    step_s: Sequence[float],
    base: RooflineParams,
    iters: int = 4000,
) -> RooflineParams:
    """Fit OOCO Table 4's F_g, F_ap, F_ad, M_g, M_a, O_p, O_d to measured steps (B_c, the tile,
    knee and kernel tables stay as in `base`). A handful of steps covering prefill, small and
    large decode batches pins every parameter that any of those steps is bound by."""
    y = np.asarray(step_s, dtype=np.float64)
    if len(batches) != len(y) or len(y) < 3:
        raise ValueError("need >= 3 steps and one time per batch")
    x0 = [np.log(getattr(base, f)) for f in _STEP_FIELDS] + [
        np.log(max(base.O_p, 1e-6)),
        np.log(max(base.O_d, 1e-6)),
    ]

    def params_of(th: npt.NDArray[np.float64]) -> RooflineParams:
        vals = dict(zip(_STEP_FIELDS, np.exp(th[:5]).tolist(), strict=True))
        return dataclasses.replace(base, **vals, O_p=float(np.exp(th[5])), O_d=float(np.exp(th[6])))

    def loss(th: npt.NDArray[np.float64]) -> float:
        m = RooflineModel(model, params_of(th), tp)
        p = np.fromiter((m.step_s(b) for b in batches), dtype=np.float64, count=len(y))
        return float(np.mean((p / y - 1.0) ** 2))

    th, _ = nelder_mead(loss, x0, step=0.5, iters=iters, tol=1e-14)
    th, _ = nelder_mead(loss, th, step=0.05, iters=iters, tol=1e-16)  # restart: NM can stall
    return params_of(th)
