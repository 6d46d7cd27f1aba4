"""`tidal bench perf-cost` (what a latency prediction and HyGen's regression fit cost) and
`tidal bench step-log` (a real step log from the torch engine, to fit the models on)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    cost = sub.add_parser(
        "perf-cost", help="step-latency models: prediction cost and regression fit time"
    )
    cost.add_argument("--samples", type=int, default=80_000, help="steps in the regression fit")
    cost.add_argument("--json", help="also write the figures to this JSON file")
    cost.set_defaults(func=_bench)

    rec = sub.add_parser("step-log", help="record a real step log from the torch engine")
    rec.add_argument("--out", required=True, help="step log to append to")
    rec.add_argument("--steps", type=int, default=1000)
    rec.add_argument("--model", help="HF directory or GGUF (default: the embedded SmolLM2)")
    rec.add_argument("--device", default="cpu")
    rec.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = default)")
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--max-prompt", type=int, default=384, help="longest prompt, tokens")
    rec.add_argument("--max-output", type=int, default=64, help="longest output, tokens")
    rec.add_argument(
        "--populations", default="",
        help="requests in the engine, one drawn every 40 steps (comma-separated; default "
        "1,2,4,8,16,32,48); each step decodes a random share of them",
    )  # fmt: skip
    rec.add_argument("--kv-cache-tokens", type=int, default=65536)
    rec.add_argument(
        "--clock", choices=("wall", "thread"), default="wall",
        help="step_s as wall time, or the stepping thread's CPU time (shared machines)",
    )  # fmt: skip
    rec.set_defaults(func=_record)


def _bench(args: argparse.Namespace) -> int:
    from tidal_bench.perf.cost import run_bench

    text = json.dumps(run_bench(args.samples), indent=2, default=float)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def _record(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from tidal_bench.perf.record import POPULATIONS, record_engine_log

    with Progress() as bar:
        task = bar.add_task("recording engine steps", total=args.steps)
        record_engine_log(
            args.out,
            args.steps,
            args.model,
            args.device,
            args.threads or None,
            args.seed,
            max_prompt=args.max_prompt,
            max_output=args.max_output,
            clock=args.clock,
            populations=_populations(args.populations) if args.populations else POPULATIONS,
            kv_cache_tokens=args.kv_cache_tokens,
            progress=lambda i: bar.update(task, completed=i),
        )
    print(f"appended {args.steps} real {args.device} steps to {args.out}")
    return 0


def _populations(spec: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"--populations: comma-separated request counts, got {spec!r}") from None
    if not out:
        raise SystemExit("--populations: give at least one request count")
    return out
