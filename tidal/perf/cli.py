"""`tidal perf ...`: fit and validate the step-latency models (what they cost, and a real step
log to fit them on: `tidal bench perf-cost`, `tidal bench step-log`).

tidal perf fit      --kernel-timings CSV | --log STEPS  --out PROFILE.json
tidal perf validate --kernel-timings CSV | --log STEPS  [--profile PROFILE.json] [--json PATH]
tidal perf synth-log --kernel-timings CSV --out STEPS.jsonl   (a log until the engine has one)
tidal perf budget   --model M --hardware H --target 0.1 [--metric p99_tbt]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

METRICS = ("mean_tbt", "p99_tbt", "mean_ttft", "p99_ttft")  # as tidal.perf.profiler.METRICS


def register(subparsers: argparse._SubParsersAction) -> None:
    perf = subparsers.add_parser("perf", help="step-latency models: fit, validate, budget")
    sub = perf.add_subparsers(dest="perf_cmd", required=True)

    def data_args(p: argparse.ArgumentParser) -> None:
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--log", help="step log, JSON lines of StepTelemetry fields")
        src.add_argument("--kernel-timings", help="per-operator GPU timing CSV (vidur format)")
        p.add_argument("--model", help="catalogue model of the step log (enables the roofline fit)")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the step log")
        p.add_argument(
            "--hardware", help="catalogue hardware (default: guessed from the file name)"
        )

    fit = sub.add_parser("fit", help="fit every model the data supports and write a profile")
    data_args(fit)
    fit.add_argument("--out", required=True, help="profile JSON to write")
    fit.set_defaults(func=_fit)

    val = sub.add_parser("validate", help="MAPE of the models on the data")
    data_args(val)
    val.add_argument("--profile", help="score this fitted profile on all the data")
    val.add_argument("--json", help="also write the figures to this JSON file")
    val.set_defaults(func=_validate)

    syn = sub.add_parser("synth-log", help="step log from measured dense kernels + attention")
    syn.add_argument("--kernel-timings", required=True)
    syn.add_argument("--out", required=True)
    syn.add_argument("--steps", type=int, default=20_000)
    syn.add_argument("--tp", type=int, default=1)
    syn.add_argument("--layers", type=int, default=32)
    syn.add_argument("--noise", type=float, default=0.01, help="relative lognormal noise")
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=_synth)

    bud = sub.add_parser("budget", help="HyGen SLO-aware profiler: binary-search the step budget")
    bud.add_argument("--model", default="llama-2-7b")
    bud.add_argument("--hardware", default="a100-80gb")
    bud.add_argument("--tp", type=int, default=1)
    bud.add_argument("--profile", help="profile for the step model (default: uncalibrated)")
    bud.add_argument("--kind", default="roofline", choices=("roofline", "regression", "modulewise"))
    bud.add_argument(
        "--metric", default="p99_tbt", choices=("mean_tbt", "p99_tbt", "mean_ttft", "p99_ttft")
    )
    bud.add_argument("--target", type=float, required=True, help="SLO target, seconds")
    bud.add_argument("--rate", type=float, default=2.0, help="online requests per second")
    bud.add_argument("--requests", type=int, default=300)
    bud.add_argument("--seed", type=int, default=0)
    bud.set_defaults(func=_budget)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("starting", total=total)

        def step(msg: str) -> None:
            bar.update(task, description=msg, advance=1)

        yield step


def _emit(result: dict[str, Any], json_path: str | None) -> None:
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def _model(args: argparse.Namespace) -> Any:
    from tidal.perf.catalog import model_spec

    return model_spec(args.model) if args.model else None


def _fit(args: argparse.Namespace) -> int:
    from tidal.perf.profile import save_profile
    from tidal.perf.validate import fit_kernels, fit_log

    if args.kernel_timings:
        from tidal.perf.kernel_timings import read_kernel_timings

        prof = fit_kernels(read_kernel_timings(args.kernel_timings), args.hardware)
    else:
        from tidal.perf.steplog import read_step_log

        log = read_step_log(args.log)
        prof = fit_log(log, _model(args), args.tp, args.hardware or "a100-80gb")
    save_profile(prof, args.out)
    print(f"wrote {args.out}: sections {', '.join(k for k in prof if k in _SECTIONS)}")
    return 0


_SECTIONS = ("roofline", "regression", "modulewise", "modulewise_dense")


def _validate(args: argparse.Namespace) -> int:
    from tidal.perf.profile import load_profile
    from tidal.perf.validate import validate_kernels, validate_log

    prof = load_profile(args.profile) if args.profile else None
    with _progress(4) as step:
        if args.kernel_timings:
            from tidal.perf.kernel_timings import read_kernel_timings

            res = validate_kernels(read_kernel_timings(args.kernel_timings), prof, step)
        else:
            from tidal.perf.steplog import read_step_log

            log = read_step_log(args.log)
            hw = args.hardware or "a100-80gb"
            res = validate_log(log, _model(args), args.tp, hw, prof, progress=step)
    if args.profile:
        res["profile"] = args.profile
    _emit(res, args.json)
    return 0


def _synth(args: argparse.Namespace) -> int:
    from tidal.perf.kernel_timings import read_kernel_timings
    from tidal.perf.steplog import synthetic_step_log, write_step_log

    kt = read_kernel_timings(args.kernel_timings)
    log = synthetic_step_log(kt, args.tp, args.layers, args.steps, args.noise, args.seed)
    write_step_log(args.out, log.batches, log.step_s)
    print(f"wrote {len(log)} steps to {args.out} ({log.source})")
    return 0


def _budget(args: argparse.Namespace) -> int:
    import numpy as np

    from tidal.perf.api import BatchShape
    from tidal.perf.factory import make_step_model
    from tidal.perf.profiler import QueueEvaluator, find_latency_budget

    model = make_step_model(args.model, args.hardware, args.tp, args.kind, args.profile)
    rng = np.random.default_rng(args.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))
    prompts = rng.integers(64, 2048, args.requests)
    outputs = rng.integers(16, 400, args.requests)
    online = [
        (float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs, strict=True)
    ]
    ev = QueueEvaluator(model, online, metric=args.metric)
    lo = model.step_s(BatchShape(num_decode_reqs=1, decode_context_tokens=1))
    res = find_latency_budget(ev, args.target, lo)
    print("emulated (step-latency model queue, not an engine):")
    _emit(
        {
            "metric": args.metric,
            "target_s": args.target,
            "budget_s": res.budget_s,
            "metric_at_budget_s": res.metric,
            "feasible": res.feasible,
            "evaluations": [list(e) for e in res.evaluations],
        },
        None,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal")
    register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
