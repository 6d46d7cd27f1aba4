"""Fit and validate every model a data set supports; the figures `tidal perf validate` prints.

Kernel timings (per-operator GPU CSVs) support the roofline's GEMM part and OmniServe's dense
table f_D; step logs support HyGen's regression, the module-wise step model and (given the model
shape) the roofline's step parameters. Without a profile, each check fits on one part of the data
and reports MAPE on the rest; with a profile, it reports the profile's MAPE on all the data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.perf.calibrate import (
    fit_kernel_roofline,
    fit_step_roofline,
    mape,
    predict_kernel_gemms,
)
from tidal.perf.catalog import ModelSpec, hardware_spec
from tidal.perf.kernel_timings import KernelTimings
from tidal.perf.modulewise import (
    ModuleWiseModel,
    build_dense_table,
    fit_modulewise_steps,
    modulewise_from_dict,
    modulewise_to_dict,
)
from tidal.perf.profile import roofline_from_dict, roofline_to_dict
from tidal.perf.regression import RegressionModel, fit_regression
from tidal.perf.roofline import RooflineModel, RooflineParams
from tidal.perf.steplog import StepLog

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


def guess_hardware(source: str) -> str:
    s = source.lower()
    for key, name in (("h100", "h100"), ("h200", "h200"), ("h800", "h800"), ("a40", "a40")):
        if key in s:
            return name
    return "a100-80gb"


def heldout_token_mask(kt: KernelTimings, every: int = 5) -> npt.NDArray[np.bool_]:
    """Hold out every `every`-th distinct token count (offset 2: never the end points)."""
    ns = np.unique(kt.num_tokens)
    return np.isin(kt.num_tokens, ns[2::every])


def _gemm_mape(params: RooflineParams, kt: KernelTimings, mask: npt.NDArray[np.bool_]) -> dict:
    y, p = kt.gemm_s()[mask], predict_kernel_gemms(params, kt)[mask]
    return {"per_op_mape": mape(p, y), "layer_gemm_sum_mape": mape(p.sum(1), y.sum(1))}


def dense_s(kt: KernelTimings) -> npt.NDArray[np.float64]:
    """(R,) seconds of all token-wise operators of one layer (OmniServe's dense modules)."""
    return np.sum(list(kt.op_s.values()), axis=0)


def dense_tables(kt: KernelTimings, mask: npt.NDArray[np.bool_]) -> dict[int, tuple]:
    """Alg. 1 per TP degree, probing only the measured rows in `mask` (a probe at a token count
    that was not measured reads the nearest measured one, as a profiler limited to those would)."""
    out: dict[int, tuple] = {}
    y = dense_s(kt)
    for tp in np.unique(kt.tp):
        rows = np.flatnonzero(mask & (kt.tp == tp))
        ns, ys = kt.num_tokens[rows], y[rows]
        order = np.argsort(ns)
        ns, ys = ns[order], ys[order]

        def lat(n: int, ns: npt.NDArray = ns, ys: npt.NDArray = ys) -> float:
            return float(ys[int(np.argmin(np.abs(ns - n)))])

        knots = build_dense_table(lat, int(ns[0]), int(ns[-1]))
        # keep only the knots that are real measurements (the probes snapped to them)
        snapped = {float(ns[int(np.argmin(np.abs(ns - k)))]): v for k, v in knots}
        out[int(tp)] = tuple(sorted(snapped.items()))
    return out


def _dense_accuracy(tables: dict[int, tuple], kt: KernelTimings, mask: npt.NDArray) -> dict:
    y = dense_s(kt)
    pred = np.zeros(kt.num_rows)
    for r in np.flatnonzero(mask):
        t = tables.get(int(kt.tp[r]))
        if t is None:
            return {"error": f"profile has no dense table for tp={int(kt.tp[r])}"}
        m = ModuleWiseModel(1, 0, 0, 0, 0, 0, t)
        pred[r] = m.f_d(float(kt.num_tokens[r]))
    e = mape(pred[mask], y[mask])
    knots = {k: len(v) for k, v in tables.items()}
    return {"mape": e, "accuracy": max(0.0, 1.0 - e), "num_knots": knots}


def fit_kernels(kt: KernelTimings, hardware: str | None = None) -> dict[str, Any]:
    hw = hardware or guess_hardware(kt.source)
    base = RooflineParams.from_hardware(hardware_spec(hw), kt.model.bytes_per_value)
    everything = np.ones(kt.num_rows, dtype=bool)
    return {
        "source": kt.source,
        "hardware": hw,
        "roofline": roofline_to_dict(fit_kernel_roofline(kt, base)),
        "modulewise_dense": {
            str(k): [list(x) for x in v] for k, v in dense_tables(kt, everything).items()
        },
    }


def validate_kernels(
    kt: KernelTimings, profile: dict[str, Any] | None = None, progress: Progress = _noop
) -> dict[str, Any]:
    hw = guess_hardware(kt.source)
    spec = hardware_spec(hw)
    out: dict[str, Any] = {"source": kt.source, "rows": kt.num_rows, "hardware": hw}
    if profile is not None:
        everything = np.ones(kt.num_rows, dtype=bool)
        if "roofline" in profile:
            out["roofline_profile"] = _gemm_mape(
                roofline_from_dict(profile["roofline"]), kt, everything
            )
        if "modulewise_dense" in profile:
            tables = {
                int(k): tuple(tuple(x) for x in v) for k, v in profile["modulewise_dense"].items()
            }
            out["modulewise_dense_profile"] = _dense_accuracy(tables, kt, everything)
        return out
    base = RooflineParams.from_hardware(spec, kt.model.bytes_per_value)
    held = heldout_token_mask(kt)
    train = kt.subset(~held)
    peaks = dataclasses.replace(base, F_g=spec.flops(), M_g=spec.mem_bw, O_k=0.0)
    out["roofline_datasheet_all_rows"] = _gemm_mape(peaks, kt, np.ones(kt.num_rows, dtype=bool))
    progress("roofline: held-out token counts")
    p_tab = fit_kernel_roofline(train, base)
    out["roofline_heldout_tokens"] = {**_gemm_mape(p_tab, kt, held), "params": _summary(p_tab)}
    p_plain = dataclasses.replace(p_tab, gemm_eff=())
    out["roofline_heldout_tokens_no_tables"] = _gemm_mape(p_plain, kt, held)
    out["roofline_heldout_tokens_3param_max"] = _gemm_mape(_refit_max(train, base), kt, held)
    progress("roofline: calibrate on TP 1, predict TP 2-8")
    tp1 = kt.tp == 1
    if tp1.any() and (~tp1).any():
        p_tp1 = fit_kernel_roofline(kt.subset(tp1), base)
        out["roofline_cross_tp"] = {**_gemm_mape(p_tp1, kt, ~tp1), "params": _summary(p_tp1)}
    progress("module-wise: Alg. 1 dense tables")
    out["modulewise_dense_heldout_tokens"] = _dense_accuracy(dense_tables(kt, ~held), kt, held)
    return out


def _refit_max(kt: KernelTimings, base: RooflineParams) -> RooflineParams:
    """The issue's reference point: three parameters (F, M, one overhead) under Eq. 1's max."""
    from tidal.perf.calibrate import _gemm_terms, nelder_mead

    flops, nbytes = _gemm_terms(kt.model, kt.num_tokens, kt.tp, 1)
    y = kt.gemm_s()

    def loss(th: npt.NDArray[np.float64]) -> float:
        p = np.maximum(flops / np.exp(th[0]) / 1e12, nbytes / np.exp(th[1]) / 1e12) + th[2] * 1e-6
        return mape(p, y) if th[2] >= 0 else 1e9

    th, _ = nelder_mead(loss, [np.log(base.F_g / 1e12), np.log(base.M_g / 1e12), 5.0])
    return dataclasses.replace(
        base, F_g=float(np.exp(th[0]) * 1e12), M_g=float(np.exp(th[1]) * 1e12), O_k=th[2] * 1e-6
    )


def _summary(p: RooflineParams) -> dict[str, Any]:
    return {
        "F_g_TFLOPs": p.F_g / 1e12,
        "M_g_TBs": p.M_g / 1e12,
        "O_k_us": p.O_k * 1e6,
        "knee": p.knee,
        "tile_tokens": p.tile_tokens,
        "num_shape_tables": len(p.gemm_eff),
    }


# ---- step logs ------------------------------------------------------------------------------


def fit_log(
    log: StepLog, model: ModelSpec | None, tp: int = 1, hardware: str = "a100-80gb"
) -> dict[str, Any]:
    sp, sd, n_p, n_d = log.features()
    out: dict[str, Any] = {"source": log.source, "tp": tp, "hardware": hardware}
    out["regression"] = {"coef": list(fit_regression(sp, sd, n_p, n_d, log.step_s).coef)}
    layers = model.num_layers if model else 1
    out["modulewise"] = modulewise_to_dict(fit_modulewise_steps(log.batches, log.step_s, layers))
    if model is not None:
        out["model"] = model.name
        base = RooflineParams.from_hardware(hardware_spec(hardware), model.bytes_per_value)
        # OOCO calibrates from "a small amount of profiling data": a random 400 steps suffice
        # and keep the derivative-free fit fast.
        pick = np.random.default_rng(0).permutation(len(log))[:400]
        batches = [log.batches[i] for i in pick]
        rp = fit_step_roofline(model, tp, batches, log.step_s[pick].tolist(), base)
        out["roofline"] = roofline_to_dict(rp)
    return out


def _eval_profile_on_log(
    profile: dict[str, Any], log: StepLog, model: ModelSpec | None, tp: int
) -> dict:
    res: dict[str, Any] = {}
    if "regression" in profile:
        reg = RegressionModel(tuple(profile["regression"]["coef"]))
        feats = log.features()
        pred = reg.predict(*feats)
        res["regression_mape"] = mape(pred, log.step_s)
        sp, nd = feats[0], feats[3]
        kinds = {"decode_only": sp == 0, "prefill_only": nd == 0, "mixed": (sp > 0) & (nd > 0)}
        res["regression_mape_by_kind"] = {
            k: mape(pred[m], log.step_s[m]) for k, m in kinds.items() if m.any()
        }
    if "modulewise" in profile:
        mw = modulewise_from_dict(profile["modulewise"])
        e = mape([mw.step_s(b) for b in log.batches], log.step_s)
        res["modulewise_mape"] = e
        res["modulewise_accuracy"] = max(0.0, 1.0 - e)
    if "roofline" in profile and model is not None:
        rm = RooflineModel(model, roofline_from_dict(profile["roofline"]), tp)
        res["roofline_mape"] = mape([rm.step_s(b) for b in log.batches], log.step_s)
    return res


def validate_log(
    log: StepLog,
    model: ModelSpec | None,
    tp: int = 1,
    hardware: str = "a100-80gb",
    profile: dict[str, Any] | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    progress: Progress = _noop,
) -> dict[str, Any]:
    out: dict[str, Any] = {"source": log.source, "steps": len(log)}
    if profile is not None:
        return {**out, **_eval_profile_on_log(profile, log, model, tp)}
    test = np.random.default_rng(seed).random(len(log)) < test_fraction
    train = log.subset(~test)
    progress("fitting on the training steps")
    fitted = fit_log(train, model, tp, hardware)
    progress("scoring held-out steps")
    held = log.subset(test)
    out["heldout_steps"] = int(test.sum())
    out.update(_eval_profile_on_log(fitted, held, model, tp))
    if model is not None:  # OOCO's "handful of measured steps": the roofline from 20 of them
        progress("roofline from 20 steps")
        pick = np.random.default_rng(seed).permutation(np.flatnonzero(~test))[:20]
        base = RooflineParams.from_hardware(hardware_spec(hardware), model.bytes_per_value)
        few = fit_step_roofline(
            model, tp, [log.batches[i] for i in pick], log.step_s[pick].tolist(), base
        )
        rm, um = RooflineModel(model, few, tp), RooflineModel(model, base, tp)
        y = held.step_s
        out["roofline_mape_fit_on_20_steps"] = mape([rm.step_s(b) for b in held.batches], y)
        out["roofline_mape_uncalibrated"] = mape([um.step_s(b) for b in held.batches], y)
    return out
