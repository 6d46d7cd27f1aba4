"""``tidal sim tolerance``: HyGen §5.2's throughput experiment (simulated results).

One command per config: the pure online reference, then for each tolerance (the config's
`slo_tolerances`, or `--tolerance METRIC=RATIO`, repeatable) HyGen*'s profiled offline QPS and
HyGen's profiled latency budget (`tidal.sim.tolerance`), and the two headline ratios; the best
of each over the tolerances is HyGen's "up to".
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tidal.config.cluster import ClusterConfig
from tidal.config.tolerance import Tolerance


def add_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="METRIC=RATIO",
        help="SLO: METRIC (tbt_mean, tbt_p99, ttft_mean, ttft_p99) at most (1 + RATIO) x pure "
        "online's, e.g. tbt_p99=0.05 (repeat for several; default: the config's slo_tolerances)",
    )
    t.add_argument("--online-policy", default="aggregated", help="pure online serving (Sarathi)")
    t.add_argument("--rate-policy", default="hygen-star", help="searched by offline QPS (HyGen*)")
    t.add_argument("--budget-policy", default="hygen", help="searched by latency budget (HyGen)")
    t.add_argument("--start-qps", type=float, default=0.25, help="first offline QPS probed")
    t.add_argument("--max-qps", type=float, default=64.0, help="stop growing the load here")
    t.add_argument("--iters", type=int, default=4, help="bisection steps of both searches")
    t.add_argument(
        "--budget-range",
        default="0.01,0.1",
        metavar="LO,HI",
        help="latency budgets (s) the profiler searches, from HI down",
    )
    t.add_argument(
        "--best-of",
        action="append",
        default=[],
        metavar="POLICY.PARAM=V1,V2,...",
        help="profile the budget policy's budget at each setting of PARAM and keep the one with "
        "the most offline tokens/s (repeat for a grid), e.g. "
        "hygen.online_prefill_budgeted=true,false",
    )


def _budget_range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    try:
        rng = (float(lo), float(hi))
    except ValueError as e:
        raise ValueError(f"--budget-range {text!r}: expected LO,HI in seconds") from e
    if not 0 < rng[0] <= rng[1]:
        raise ValueError(f"--budget-range {text!r}: need 0 < LO <= HI")
    return rng


def tolerance_cmd(
    args: argparse.Namespace,
    cfg: ClusterConfig,
    console: Console,
    progress: Callable[[], Any],
    write: Callable[[Path, dict[str, Any]], None],
) -> int:
    from tidal.sim.best_of import parse_best_of
    from tidal.sim.tolerance import pure_online, tolerance_search

    tols = [Tolerance.parse(t) for t in args.tolerance] or list(cfg.slo_tolerances)
    if not tols:
        raise ValueError("no tolerance: give --tolerance METRIC=RATIO or slo_tolerances")
    budget_range = _budget_range(args.budget_range)
    for spec in args.best_of:
        if spec.partition(".")[0].strip() != args.budget_policy:
            raise ValueError(
                f"--best-of {spec!r}: only the budget policy ({args.budget_policy}) is profiled "
                "at several settings"
            )
    settings = parse_best_of(args.best_of, [args.budget_policy]).get(args.budget_policy, [()])
    out = Path(args.out)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with progress() as prog:
        task = prog.add_task("pure online", total=None)

        def on_probe(p: str, x: float, s: dict[str, Any]) -> None:
            prog.update(task, advance=1, description=f"{p} probes (last {x:g})")

        ref = pure_online(cfg, args.online_policy)
        for tol in tols:
            res = tolerance_search(
                cfg,
                tol,
                ref,
                args.rate_policy,
                args.budget_policy,
                args.start_qps,
                args.max_qps,
                args.iters,
                budget_range,
                args.iters,
                on_probe,
                settings,
            )
            rows.append(res.row())
            _print_row(console, rows[-1])
    best = {
        k: max((r[k] for r in rows if r[k] is not None), default=None)
        for k in ("total_vs_pure_online", "generated_vs_pure_online", "offline_vs_rate_policy")
    }
    summary: dict[str, Any] = {
        "label": "simulated",
        "config": cfg.name,
        "method": "tolerance (HyGen §5.2)",
        "duration_s": cfg.duration_s,
        "seed": cfg.seed,
        "online_policy": args.online_policy,
        "best_of": list(args.best_of),
        "pure_online": {
            "total_tokens_per_s": ref["online"]["total_tokens_per_s"],
            "tokens_per_s": ref["online"]["tokens_per_s"],
            "tbt_s": ref["online"]["tbt_s"],
            "ttft_s": ref["online"]["ttft_s"],
            "num_requests": ref["online"]["num_requests"],
        },
        "tolerances": rows,
        "best": best,
        "wall_s": time.perf_counter() - t0,
    }
    write(out, summary)
    console.print(
        f"\\[simulated] pure online ({args.online_policy}): "
        f"{ref['online']['total_tokens_per_s']:.0f} tok/s (prompt + output)"
    )
    console.print(
        f"\\[simulated] best: total vs pure online {_x(best['total_vs_pure_online'])}, "
        f"offline vs {args.rate_policy} {_x(best['offline_vs_rate_policy'])}"
    )
    console.print(f"wrote {out / 'summary.json'}")
    return 0


def _print_row(console: Console, r: dict[str, Any]) -> None:
    star, hy = r["rate_policy"], r["budget_policy"]
    budget = hy["latency_budget_s"]
    console.print(
        f"\\[simulated] {r['tolerance']} (bound {1e3 * r['bound_s']:.1f} ms): "
        f"{star['policy']} {star['offline_qps']:.3g} QPS, {star['offline_tokens_per_s']:.0f} "
        f"offline tok/s; {hy['policy']} budget "
        + ("none" if budget is None else f"{1e3 * budget:.1f} ms")
        + (f" ({hy['setting']})" if hy["setting"] else "")
        + f", {hy['offline_tokens_per_s']:.0f} offline tok/s; total vs pure online "
        f"{_x(r['total_vs_pure_online'])}, offline vs {star['policy']} "
        f"{_x(r['offline_vs_rate_policy'])}"
    )


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"
