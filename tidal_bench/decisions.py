"""Scheduling cost per decision on a 256-request batch (issue #6 target 5), measured, not
estimated. Run: `python -m tidal_bench.decisions [--repeats N] [--model M --hardware H]`.

Each row times one decision of one algorithm on a fixed state with 256 requests, using the
roofline step model of `tidal.perf` (Qwen2.5-7B on A100-80GB by default), and prints the median
and p90 in microseconds. The state is rebuilt outside the timed region.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from tidal.perf.api import StepModel
from tidal.policy.batch_shape import decode_shape
from tidal.policy.hygen.batch import HyReq, two_phase_schedule
from tidal.policy.omniserve.control import admit_ls, fit_decodes, max_chunk
from tidal.policy.ooco.migration import length_preference
from tidal.policy.ooco.mix_decode import DecodeCandidate, select_mix_decode
from tidal.policy.taichi.flowing import FlowReq, select_degrading
from tidal.policy.taichi.routing import PrefillTarget, route_prefill

N = 256


def cases(model: StepModel, rng: random.Random) -> dict[str, Callable[[], object]]:
    ctx = [rng.randint(200, 4000) for _ in range(N)]
    on = [DecodeCandidate(f"on{i}", c) for i, c in enumerate(ctx[:64])]
    off = [DecodeCandidate(f"off{i}", c) for i, c in enumerate(ctx[64:])]
    slo = model.step_s(decode_shape(ctx)) * 0.8  # only part of the offline set fits
    batch = decode_shape(ctx[:128])
    hy_dec = [HyReq(f"d{i}", c, c, c // 16 + 1) for i, c in enumerate(ctx[:200])]
    hy_wait = [HyReq(f"w{i}", c) for i, c in enumerate(ctx[200:])]
    targets = [
        PrefillTarget(i, i < 2, 1024 if i < 2 else 256, ctx[i * 8 : i * 8 + 8], batch, model)
        for i in range(4)
    ]
    flows = [FlowReq(f"r{i}", rng.randint(1, 500), 0.05, c // 16) for i, c in enumerate(ctx)]
    return {
        "ooco.alg2_mix_decode(K=8)": lambda: select_mix_decode(
            model, on, off, slo, 8, random.Random(1)
        ),
        "ooco.alg1_length_preference": lambda: length_preference(
            model, batch, True, 0.1, 0.9, 256, 10**6, 200, 32768
        ),
        "hygen.two_phase_schedule": lambda: two_phase_schedule(
            model, slo, 2048, 16, 10**5, hy_dec[:64], [], hy_dec[64:], hy_wait
        ),
        "taichi.alg2_route_prefill(4 inst)": lambda: route_prefill(3000, targets, 2.0, 0.01),
        "taichi.alg1_select_degrading": lambda: select_degrading(flows, 4000, 4000, 0.9),
        "omniserve.admit+chunk+be_decode": lambda: (
            admit_ls(model, [(4000, 0)] * 4, batch, 2000, 2.0),
            max_chunk(model, batch, 4000, 0, 0.1, 2048),
            fit_decodes(model, batch, ctx[128:], 0.1),
        ),
    }


def bench(model: StepModel, repeats: int, cold: bool = False) -> list[tuple[str, float, float]]:
    """(name, median µs, p90 µs) per algorithm. `cold` empties the step model's memo (the
    roofline remembers GEMM times per token count) before every timed decision."""
    clear = getattr(model, "clear_memo", None) if cold else None
    out = []
    for name, fn in cases(model, random.Random(0)).items():
        for _ in range(20):
            fn()  # warm-up
        ts = []
        for _ in range(repeats):
            if clear is not None:
                clear()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        ts.sort()
        out.append((name, statistics.median(ts), ts[int(0.9 * (len(ts) - 1))]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=300, help="timed runs per algorithm")
    ap.add_argument("--model", default="qwen2.5-7b", help="model for the roofline step model")
    ap.add_argument("--hardware", default="a100-80gb", help="hardware for the roofline model")
    ap.add_argument(
        "--cold", action="store_true", help="empty the step model's memo before every decision"
    )
    args = ap.parse_args(argv)
    from tidal.perf import make_step_model

    model = make_step_model(args.model, args.hardware)
    print(f"scheduling cost per decision, {N}-request batch, {args.model} roofline on CPU:")
    if args.cold:
        print("(cold: the roofline's per-token-count memo is emptied before every decision)")
    for name, med, p90 in bench(model, args.repeats, args.cold):
        print(f"  {name:36s} median {med:8.1f} µs   p90 {p90:8.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
