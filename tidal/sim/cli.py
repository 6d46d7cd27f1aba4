"""``tidal sim run | max-offline | goodput | max-online | tolerance``: the simulator (simulated)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tidal.config.cluster import ClusterConfig, load_config, override_streams
from tidal.sim.cli_tolerance import add_arguments as add_tolerance_arguments

console = Console(stderr=True)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML experiment file (configs/*.yaml)")
    p.add_argument("--out", required=True, help="directory for summary.json and the PNG plots")
    p.add_argument("--online-trace", help="CSV arrival_s,input_tokens,output_tokens (online)")
    p.add_argument("--offline-lengths", help="CSV of offline lengths (arrival column ignored)")
    p.add_argument("--seed", type=int, help="workload seed (default: the config's)")
    p.add_argument("--duration", type=float, help="workload window in seconds (default: config)")
    p.add_argument("--slo", help="name of one of the config's slo_variants (e.g. slo2)")
    p.add_argument("--jobs", type=int, default=1, help="searches: policies run in parallel")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. cpu_workers.count=0 or instances[1].chunk_size=128",
    )


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `sim` command and its three subcommands."""
    p = subparsers.add_parser("sim", help="discrete-event cluster simulator (simulated results)")
    sp = p.add_subparsers(dest="sim_command", required=True)
    r = sp.add_parser("run", help="one simulated run: summary.json and plots")
    _common(r)
    r.add_argument("--policy", help="policy name (default: the config's `policy`)")
    r.set_defaults(func=cmd_run)
    m = sp.add_parser("max-offline", help="OOCO §5.2: max offline load within the violation cap")
    _common(m)
    m.add_argument("--policies", required=True, help="comma-separated policy names")
    m.add_argument("--violation", type=float, default=3.0, help="online violation cap, %%")
    m.add_argument("--start-qps", type=float, default=0.25, help="first offline QPS probed")
    m.add_argument("--max-qps", type=float, default=256.0, help="stop growing the load here")
    m.add_argument("--iters", type=int, default=5, help="bisection steps")
    m.add_argument(
        "--best-of",
        action="append",
        default=[],
        metavar="POLICY.PARAM=V1,V2,...",
        help="search POLICY at each setting of PARAM and keep the one with the most offline "
        "tokens/s (repeat for a grid), e.g. online-priority.max_decode_batch=32,64,128,256",
    )
    m.set_defaults(func=cmd_max_offline)
    g = sp.add_parser("goodput", help="TaiChi §4.1: max online rate at the SLO attainment")
    _common(g)
    g.add_argument("--policies", required=True, help="comma-separated policy names")
    g.add_argument("--attainment", type=float, default=90.0, help="SLO attainment target, %%")
    g.add_argument("--start-rps", type=float, default=0.5, help="first online rate probed")
    g.add_argument("--max-rps", type=float, default=1024.0, help="stop growing the load here")
    g.add_argument("--iters", type=int, default=6, help="bisection steps")
    g.set_defaults(func=cmd_goodput)
    o = sp.add_parser(
        "max-online", help="OOCO §5.2 step 1: largest online trace scale pure online serving meets"
    )
    _common(o)
    o.add_argument("--policy", default="base-pd", help="policy serving online only")
    o.add_argument("--violation", type=float, default=1.0, help="online violation cap, %%")
    o.add_argument("--start-scale", type=float, default=0.25, help="first scale factor probed")
    o.add_argument("--max-scale", type=float, default=64.0, help="stop growing the scale here")
    o.add_argument("--iters", type=int, default=6, help="bisection steps")
    o.set_defaults(func=cmd_max_online)
    t = sp.add_parser(
        "tolerance",
        help="HyGen §5.2: throughput within a tolerance on one aggregate metric vs pure online",
    )
    _common(t)
    add_tolerance_arguments(t)
    t.set_defaults(func=cmd_tolerance)


def _config(args: argparse.Namespace) -> ClusterConfig:
    cfg = load_config(args.config, tuple(args.set))
    if args.slo:
        cfg = cfg.with_slo(args.slo)
    return override_streams(cfg, args.online_trace, args.offline_lengths, args.seed, args.duration)


@contextmanager
def _progress(search: bool = False) -> Iterator[Progress]:
    count = (
        TextColumn("{task.completed:.0f} runs")
        if search
        else TextColumn("{task.completed:.0f}/{task.total:.0f} simulated s")
    )
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        count,
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as prog:
        yield prog


def _ticker(prog: Progress, desc: str, total: float) -> Callable[[float], None]:
    task = prog.add_task(desc, total=total)

    def tick(t: float) -> None:
        prog.update(task, completed=min(t, total))

    return tick


def _write(out: Path, summary: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")


def cmd_run(args: argparse.Namespace) -> int:
    from tidal.sim.build import simulate
    from tidal.sim.metrics import REQUEST_COLUMNS, request_rows, summarize
    from tidal.sim.plots import run_plots

    cfg = _config(args)
    policy = args.policy or cfg.policy
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _progress() as prog:
        tick = _ticker(prog, f"{policy} (simulated)", cfg.duration_s + cfg.drain_s)
        rec = simulate(cfg, policy, progress=tick)
    wall = time.perf_counter() - t0
    s = summarize(rec, cfg.duration_s, policy, cfg.name)
    s["wall_s"] = wall
    s["simulated_requests_per_wall_s"] = len(rec.requests) / wall if wall > 0 else 0.0
    s["plots"] = run_plots(rec, out, f"{cfg.name} / {policy}", cfg.duration_s, _slo(cfg))
    s["requests_csv"] = "requests.csv"
    _write(out, s)
    lines = [REQUEST_COLUMNS, *request_rows(rec.requests)]
    (out / "requests.csv").write_text("\n".join(lines) + "\n")
    on, off = s["online"], s["offline"]
    console.print(
        f"\\[simulated] {cfg.name}/{policy}: online SLO attainment {on['slo_attainment_pct']:.2f}% "
        f"(TTFT viol {on['ttft_violation_pct']:.2f}%, TPOT viol {on['tpot_violation_pct']:.2f}%), "
        f"goodput {on['goodput_rps']:.2f} req/s, offline {off['tokens_per_s']:.0f} tok/s "
        f"{off['requests_per_s']:.2f} req/s; {len(rec.requests)} requests in {wall:.1f} s wall"
    )
    console.print(f"wrote {out / 'summary.json'}")
    return 0


def _slo(cfg: ClusterConfig) -> tuple[float, float]:
    return (cfg.slo.ttft_s, cfg.slo.tpot_s)


def cmd_max_offline(args: argparse.Namespace) -> int:
    from tidal.sim.cli_search import search_cmd

    return search_cmd(args, "max-offline", _config(args), console, _search_progress, _write)


def cmd_goodput(args: argparse.Namespace) -> int:
    from tidal.sim.cli_search import search_cmd

    return search_cmd(args, "goodput", _config(args), console, _search_progress, _write)


def cmd_tolerance(args: argparse.Namespace) -> int:
    from tidal.sim.cli_tolerance import tolerance_cmd

    return tolerance_cmd(args, _config(args), console, _search_progress, _write)


def _search_progress() -> Any:
    return _progress(search=True)


def cmd_max_online(args: argparse.Namespace) -> int:
    """OOCO §5.2: calibrate the online trace scale on pure online serving."""
    from tidal.sim.cli_search import probe_row
    from tidal.sim.search import max_online

    cfg = _config(args)
    out = Path(args.out)
    t0 = time.perf_counter()
    with _progress(search=True) as prog:
        task = prog.add_task(f"{args.policy} probes", total=None)

        def on_probe(p: str, x: float, s: dict[str, Any]) -> None:
            prog.update(task, advance=1, description=f"{p} probes (last scale {x:g})")

        res = max_online(
            cfg, args.policy, args.violation, args.start_scale, args.max_scale, args.iters, on_probe
        )
    b = res.best or {}
    summary = {
        "label": "simulated",
        "config": cfg.name,
        "method": "max-online",
        "policy": args.policy,
        "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s},
        "threshold": args.violation,
        "duration_s": cfg.duration_s,
        "seed": cfg.seed,
        "wall_s": time.perf_counter() - t0,
        "max_online_scale": res.best_rate,
        "online_requests_per_s": b.get("online", {}).get("num_requests", 0) / cfg.duration_s,
        "online_violation_pct": b.get("online", {}).get("violation_pct"),
        "probes": [probe_row(x, s) for x, s in res.probes],
    }
    _write(out, summary)
    console.print(
        f"\\[simulated] {args.policy}: online scale {res.best_rate:.4g} "
        f"({summary['online_requests_per_s']:.3g} req/s) at "
        f"{summary['online_violation_pct'] or 0.0:.2f}% online violation, no offline load"
    )
    console.print(f"wrote {out / 'summary.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, KeyError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
