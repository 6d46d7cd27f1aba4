"""`tidal bench colocation --search-offline`: its options, the caps it derives from the load, and
the run of every policy's search, reported by `tidal_bench.colocation.report`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from services.cli.up_args import parse_pinning
from tidal_bench.colocation import search as cs
from tidal_bench.colocation.caps import derive
from tidal_bench.colocation.report import cpu_model, merged, plot, table

console = Console(stderr=True)


def search_caps(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """`--batch-max-inflight` and `--max-qps` as given, or derived from the load
    (`tidal_bench.colocation.caps`)."""
    from tidal.sim.build import kv_geometry

    _, blocks = kv_geometry(cfg)
    return derive(
        cfg,
        args.policies,
        args.engine,
        args.sim_step_model,
        args.violation,
        args.cpu_attn if args.engine == "torch" else 0,
        blocks * cfg.block_size,
        args.batch_max_inflight,
        args.max_qps,
    )


def run_search(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.measure_s <= 0 or args.warmup_s < 0:
        print("error: --repeats >= 1, --measure-s > 0 and --warmup-s >= 0", file=sys.stderr)
        return 2
    if args.batch_max_inflight is not None and args.batch_max_inflight < 1:
        print("error: --batch-max-inflight must be >= 1", file=sys.stderr)
        return 2
    if args.max_qps is not None and args.max_qps <= 0:
        print("error: --max-qps must be > 0", file=sys.stderr)
        return 2
    try:
        parse_pinning(args)  # a bad or overlapping core list, before any stack starts
        cfg, cfg_path = cs.write_config(args, cs.temp_dir())
        # the live instances emulate the model the simulator builds from the same config
        args.sim_step_model = args.sim_step_model or cfg.step_model_spec()
        caps = search_caps(args, cfg)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.batch_max_inflight, args.max_qps = caps["batch_max_inflight"], caps["max_qps"]
    if args.start_qps > args.max_qps:
        print(
            f"error: --start-qps {args.start_qps:g} is above the largest load {args.max_qps:g} "
            f"({caps['max_qps_from']})",
            file=sys.stderr,
        )
        return 2
    on = cfg.online
    assert on is not None
    start = on.start_s
    report: dict[str, Any] = {
        "what": "live max-offline search (OOCO §5.2 on the running stack)",
        "engine": args.engine,
        "emulated": args.engine == "sim",
        "sim_step_model": args.sim_step_model if args.engine == "sim" else None,
        "config": args.config,
        "set": args.set,
        "window": f"trace seconds {start:g}-{start + cfg.duration_s:g} (first {args.warmup_s:g} s "
        f"warm-up, not counted)",
        "online_stream": {
            "source": on.source,
            "arrival": on.arrival,
            "scale": on.scale,
            "rate": on.rate,
        },
        "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s},
        "violation": args.violation,
        "repeats": args.repeats,
        "warmup_s": args.warmup_s,
        "measure_s": args.measure_s,
        "search": {"start_qps": args.start_qps, "max_qps": args.max_qps, "iters": args.iters},
        "batch_max_inflight": args.batch_max_inflight,  # live and simulated alike
        "caps": caps,  # how --batch-max-inflight and --max-qps were reached
        "host": {
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        },
        "policies": {},
    }
    earlier = None
    if args.json and args.append and Path(args.json).exists():
        earlier = json.loads(Path(args.json).read_text())
        try:
            merged(earlier, {**report, "wall_s": 0.0})
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed:.0f} windows"),
        TimeElapsedColumn(),
        console=console,
    ) as prog:
        for name, policy, workers in cs.variants(args):
            report["policies"][name] = cs.run_policy(args, cfg, cfg_path, policy, workers, prog)
    report["wall_s"] = time.perf_counter() - t0
    report["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if earlier is not None:
        report = merged(earlier, report)
    print(table(report))
    if args.json:
        png = args.plot or str(Path(args.json).with_suffix(".png"))
        report["plot"] = plot(report, png)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.json} and {png}")
    elif args.plot:
        plot(report, args.plot)
    return 0


def add_search_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("max-offline search (--search-offline)")
    g.add_argument(
        "--search-offline",
        action="store_true",
        help="search each policy's largest Batch API offline load at the online SLO",
    )
    g.add_argument("--policies", default="", help="comma-separated policies to search")
    g.add_argument("--violation", type=float, default=3.0, help="online violation cap, %%")
    g.add_argument("--config", default="", help="experiment config (default: per engine)")
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value for the stack and the simulator alike",
    )
    g.add_argument(
        "--sim-step-model",
        default="",
        help="sim engine step times, emulated: MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH] "
        "(default: the config's, as the simulator builds it)",
    )
    g.add_argument("--max-model-len", type=int, default=8192, help="sim engine context length")
    g.add_argument(
        "--cpu-attn", type=int, default=1, help="CPU-attention workers every policy's stack gets"
    )
    g.add_argument(
        "--without-cpu-attn",
        default="tidal",
        help="policies also searched with no CPU-attention worker (torch engine)",
    )
    g.add_argument(
        "--batch-max-inflight",
        type=int,
        default=None,
        help="Batch API lines running at once in every policy's stack (tidal up's flag) and "
        "in the simulator beside it (default: as many as the instances' KV pools hold at the "
        "offline mix's mean length)",
    )
    g.add_argument(
        "--engine-cores",
        default=None,
        help="pin every policy's instances to these cores (tidal up's flag; default unpinned)",
    )
    g.add_argument(
        "--cpu-attn-cores",
        default=None,
        help="pin every policy's CPU-attention workers here, disjoint from --engine-cores",
    )
    g.add_argument(
        "--service-cores",
        default=None,
        help="pin the control plane and this load generator here (may overlap the workers')",
    )
    g.add_argument("--measure-s", type=float, default=10.0, help="measured part of a window")
    g.add_argument("--repeats", type=int, default=3, help="windows per offline load")
    g.add_argument("--start-qps", type=float, default=1.0, help="first offline load probed")
    g.add_argument(
        "--max-qps",
        type=float,
        default=None,
        help="stop growing the load here (default: 1.5x the computed offline limit's lines/s, "
        "tidal.sim.limit, simulated)",
    )
    g.add_argument("--iters", type=int, default=1, help="bisection steps")
    g.add_argument(
        "--append",
        action="store_true",
        help="add these policies to the --json report of an earlier run with the same settings",
    )
    g.add_argument("--plot", default="", help="PNG path (default: the --json path's .png)")
