"""Cost of the models: one `step_s` call per kind, the inverse, and HyGen's regression fit on
80,000 samples (HyGen §5: ~15 ms). Timings are wall clock on this machine."""

from __future__ import annotations

import dataclasses
import time
import timeit
from typing import Any

import numpy as np

from tidal.perf.api import BatchShape, StepModel
from tidal.perf.factory import make_step_model
from tidal.perf.helpers import max_prefill_tokens
from tidal.perf.modulewise import ModuleWiseModel, default_dense_knots
from tidal.perf.regression import fit_regression
from tidal.perf.roofline import RooflineModel


def _batches(rng: np.random.Generator, k: int = 256) -> list[BatchShape]:
    out = []
    for _ in range(k):
        sp = int(rng.integers(0, 1024))
        n_p = int(rng.integers(1, 4)) if sp else 0
        nd = int(rng.integers(0, 256)) if sp else int(rng.integers(1, 256))
        ctx = nd * int(rng.integers(100, 4000))  # mean context varies, or S_d ∝ N_d (collinear)
        out.append(BatchShape(sp, n_p, sp * (sp + int(rng.integers(0, 2048))), nd, ctx))
    return out


def _per_call_us(model: StepModel, batches: list[BatchShape], repeat: int = 5) -> float:
    step = model.step_s
    n = len(batches)

    def run() -> None:
        for b in batches:
            step(b)

    loops = 20
    return min(timeit.repeat(run, number=loops, repeat=repeat)) / (loops * n) * 1e6


def run_bench(num_samples: int = 80_000, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    batches = _batches(rng)
    roof = make_step_model("llama-2-7b", "a100-80gb", kind="roofline")
    knots = default_dense_knots(4096)
    mw = ModuleWiseModel(
        32, 1e-12, 1e-5, 1e-9, 1e-7, 1e-5, tuple((float(k), 1e-5 + k * 1e-8) for k in knots)
    )
    prof = {"regression": {"coef": [1e-2, 5e-5, 4e-7, 4e-9, 1e-15, -3e-4, 6e-5]}}
    reg = make_step_model("llama-2-7b", "a100-80gb", kind="regression", profile=prof)
    # The calibrated roofline's worst case: knee on, a 200-knot table for every GEMM shape (what
    # `tidal perf fit --kernel-timings` produces for the vidur CSVs).
    assert isinstance(roof, RooflineModel)
    knots200 = tuple((float(n), 1.0 + 0.01 * (n % 7)) for n in range(1, 4097, 20))
    tables = tuple((g.din, g.dout, knots200) for g in roof.gemms)
    calibrated = RooflineModel(
        roof.model, dataclasses.replace(roof.params, knee=1.5, tile_tokens=64, gemm_eff=tables)
    )
    out: dict[str, Any] = {
        "step_s_us": {
            "roofline": _per_call_us(roof, batches),
            "roofline_calibrated_knee_tables": _per_call_us(calibrated, batches),
            "regression": _per_call_us(reg, batches),
            "modulewise": _per_call_us(mw, batches),
        }
    }
    base = BatchShape(num_decode_reqs=64, decode_context_tokens=64 * 1200)
    t = timeit.repeat(
        lambda: max_prefill_tokens(roof, 0.05, base, limit=4096), number=200, repeat=3
    )
    out["max_prefill_tokens_us"] = {"roofline_bisection": min(t) / 200 * 1e6}
    inverse = reg.max_prefill_tokens  # type: ignore[attr-defined]
    t = timeit.repeat(lambda: inverse(0.05, base), number=2000, repeat=3)
    out["max_prefill_tokens_us"]["regression_closed_form"] = min(t) / 2000 * 1e6
    # Regression fit on num_samples steps (features and roofline-labelled times with 1 % noise).
    big = _batches(rng, num_samples)
    sp = np.array([b.num_prefill_tokens for b in big], dtype=np.float64)
    sd = np.array([b.decode_context_tokens for b in big], dtype=np.float64)
    n_p = np.array([b.num_prefill_reqs for b in big], dtype=np.float64)
    n_d = np.array([b.num_decode_reqs for b in big], dtype=np.float64)
    y = np.array([roof.step_s(b) for b in big]) * np.exp(rng.normal(0, 0.01, num_samples))
    del big  # the fit sees arrays only; drop the 80k Python objects first
    fits = []
    for _ in range(7):
        t0 = time.perf_counter()
        fit_regression(sp, sd, n_p, n_d, y)
        fits.append(time.perf_counter() - t0)
    out["regression_fit_ms"] = {
        "num_samples": num_samples,
        "best": min(fits) * 1e3,
        "median": float(np.median(fits)) * 1e3,
    }
    return out
