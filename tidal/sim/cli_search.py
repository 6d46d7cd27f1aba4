"""``tidal sim max-offline | goodput``: the searches' command half (simulated results).

max-offline also reports each policy's figure as a share of the offline limit
(`tidal.sim.limit`) and, with `--best-of POLICY.PARAM=V1,V2,...`, runs a policy at each setting
and keeps the best (`tidal.sim.best_of`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from rich.console import Console

from tidal.config.cluster import ClusterConfig
from tidal.policy.registry import make_policy
from tidal.sim.best_of import Setting, label, parse_best_of, pick_best, with_setting
from tidal.sim.build import policy_context
from tidal.sim.limit import BINDINGS, config_limit
from tidal.sim.search import SearchResult

Task = tuple[str, str, ClusterConfig]  # (policy, setting label or "", its config)


def search_cmd(
    args: argparse.Namespace,
    kind: str,
    cfg: ClusterConfig,
    console: Console,
    progress: Callable[[], Any],
    write: Callable[[Path, dict[str, Any]], None],
) -> int:
    from tidal.sim.plots import search_plot

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ValueError("--policies names no policy")
    settings: dict[str, list[Setting]] = parse_best_of(getattr(args, "best_of", []), policies)
    tasks: list[Task] = []
    for pol in policies:
        for st in settings.get(pol, [()]):
            c = with_setting(cfg, pol, st) if st else cfg
            make_policy(pol, policy_context(c, pol))  # a bad name or param fails before any run
            tasks.append((pol, label(st), c))
    t0 = time.perf_counter()
    params = (
        (args.violation, args.start_qps, args.max_qps, args.iters)
        if kind == "max-offline"
        else (args.attainment, args.start_rps, args.max_rps, args.iters)
    )
    results = _run_tasks(tasks, kind, params, args.jobs, progress)
    per_policy: dict[str, Any] = {}
    curves: dict[str, list[tuple[float, float, float]]] = {}
    best: dict[str, float] = {}
    chosen_cfg: dict[str, ClusterConfig] = {}
    for pol in policies:
        mine = [(lab, c) for p, lab, c in tasks if p == pol]
        rows = {lab: _row(kind, results[(pol, lab)]) for lab, _ in mine}
        key = "max_offline_tokens_per_s" if kind == "max-offline" else "goodput_rps"
        win = pick_best({lab: r[key] for lab, r in rows.items()}) if len(mine) > 1 else mine[0][0]
        chosen_cfg[pol] = dict(mine)[win]
        res = results[(pol, win)]
        per_policy[pol] = rows[win]
        if len(mine) > 1:
            per_policy[pol]["best_of"] = {
                "chosen": win,
                "tried": {
                    lab: {k: v for k, v in r.items() if k != "probes"} for lab, r in rows.items()
                },
            }
        metric = "violation_pct" if kind == "max-offline" else "slo_attainment_pct"
        third = "tokens_per_s" if kind == "max-offline" else "goodput_rps"
        cls = "offline" if kind == "max-offline" else "online"
        curves[pol] = [(x, s["online"][metric], s[cls][third]) for x, s in res.probes]
        best[pol] = per_policy[pol].get("max_offline_qps", res.best_rate)
    summary: dict[str, Any] = {
        "label": "simulated",
        "config": cfg.name,
        "method": kind,
        "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s},
        "threshold": args.violation if kind == "max-offline" else args.attainment,
        "duration_s": cfg.duration_s,
        "seed": cfg.seed,
    }
    if kind == "max-offline":
        summary["limit"] = _limits(cfg, per_policy, chosen_cfg, args.violation)
        plot = search_plot(
            curves,
            out,
            f"{cfg.name}: online SLO violation vs offline load (OOCO Fig. 6)",
            "offline QPS offered (uniform)",
            "online SLO violation (%)",
            args.violation,
            best,
            "max_offline.png",
            "offline tokens/s generated",
        )
    else:
        plot = search_plot(
            curves,
            out,
            f"{cfg.name}: SLO attainment vs online rate (TaiChi §4.1)",
            "online request rate (req/s)",
            "SLO attainment (%)",
            args.attainment,
            best,
            "goodput.png",
            "goodput (SLO-attaining req/s)",
        )
    summary.update(wall_s=time.perf_counter() - t0, policies=per_policy, plots=[plot])
    write(out, summary)
    if kind == "max-offline":
        lim = summary["limit"]
        console.print(
            f"\\[simulated] limit: {lim['tokens_per_s']:.0f} offline tok/s beside the online load "
            f"(offline-only capacity {lim['offline_only_tokens_per_s']:.0f} tok/s; the online "
            f"load needs >= {lim['online_gpu_s']:.0f} of {lim['gpu_s']:.0f} GPU-s; bound by "
            f"{BINDINGS[lim['binding']]}, {lim['paced_steps']} paced steps = "
            f"{lim['paced_gpu_s']:.0f} GPU-s of step overhead)"
        )
    for pol, v in per_policy.items():
        chosen = f" \\[best of: {v['best_of']['chosen']}]" if "best_of" in v else ""
        if kind == "max-offline":
            console.print(
                f"\\[simulated] {pol}{chosen}: max offline {v['max_offline_qps']:.3g} QPS, "
                f"{v['max_offline_tokens_per_s']:.0f} tok/s = {100 * v['share_of_limit']:.1f}% "
                f"of the limit, at {v['online_violation_pct']:.2f}% online violation"
                + (" (offline throughput saturated)" if v["saturated"] else "")
            )
        else:
            console.print(f"\\[simulated] {pol}{chosen}: goodput {v['goodput_rps']:.3g} req/s")
    console.print(f"wrote {out / 'summary.json'}")
    return 0


def _run_tasks(
    tasks: list[Task],
    kind: str,
    params: tuple[float, float, float, int],
    jobs: int,
    progress: Callable[[], Any],
) -> dict[tuple[str, str], SearchResult]:
    results: dict[tuple[str, str], SearchResult] = {}
    with progress() as prog:
        if jobs > 1 and len(tasks) > 1:
            # One process per (policy, setting): runs are independent and deterministic.
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                ids = {(p, lab): prog.add_task(f"{p} {lab} search", total=1) for p, lab, _ in tasks}
                futs = {
                    pool.submit(search_one, kind, c, p, params): (p, lab) for p, lab, c in tasks
                }
                for fut in as_completed(futs):
                    k = futs[fut]
                    results[k] = fut.result()
                    prog.update(ids[k], completed=1, description=f"{k[0]} {k[1]} done")
        else:
            for p, lab, c in tasks:
                task = prog.add_task(f"{p} {lab} probes", total=None)

                def on_probe(q: str, x: float, s: dict[str, Any], task: Any = task) -> None:
                    prog.update(task, advance=1, description=f"{q} probes (last load {x:g})")

                results[(p, lab)] = search_one(kind, c, p, params, on_probe)
    return results


def _row(kind: str, res: SearchResult) -> dict[str, Any]:
    b = res.best or {}
    if kind == "max-offline":
        # Saturated: the offered load kept growing but completions did not; the sustained
        # rate is what completed, not what was offered.
        done_qps = b.get("offline", {}).get("requests_per_s", 0.0)
        return {
            "max_offline_qps": min(res.best_rate, done_qps) if res.saturated else res.best_rate,
            "offered_offline_qps": res.best_rate,
            "max_offline_tokens_per_s": b.get("offline", {}).get("tokens_per_s", 0.0),
            "max_offline_requests_per_s": done_qps,
            "online_violation_pct": b.get("online", {}).get("violation_pct"),
            "saturated": res.saturated,
            "probes": [probe_row(x, s) for x, s in res.probes],
        }
    return {
        "goodput_rps": res.best_rate,
        "slo_attainment_pct": b.get("online", {}).get("slo_attainment_pct"),
        "probes": [probe_row(x, s) for x, s in res.probes],
    }


def _limits(
    cfg: ClusterConfig,
    per_policy: dict[str, Any],
    chosen_cfg: dict[str, ClusterConfig],
    violation_pct: float,
) -> dict[str, Any]:
    """The offline limit (`tidal.sim.limit`) and each policy's share of it. The offline mix is
    drawn at the largest offered rate any policy reached (at least 1 QPS): more requests, a
    mix closer to the length table's."""
    rate = max([1.0, *(v["offered_offline_qps"] for v in per_policy.values())])
    by_size: dict[int, Any] = {}
    first = None
    for pol, v in per_policy.items():
        c = chosen_cfg[pol]
        n = sum(g.count for g in c.groups_for(pol))
        if n not in by_size:
            by_size[n] = config_limit(c, pol, violation_pct, rate)
        lim = by_size[n]
        first = first or lim
        v["limit_tokens_per_s"] = lim.limit_tokens_per_s
        v["share_of_limit"] = lim.share(v["max_offline_tokens_per_s"])
    assert first is not None
    return {
        "label": "simulated",
        "tokens_per_s": first.limit_tokens_per_s,
        "offline_only_tokens_per_s": first.offline_only_tokens_per_s,
        "gpu_s": first.gpu_s,
        "online_gpu_s": first.online_gpu_s,
        "cpu_credit_s": first.cpu_credit_s,
        "offline_s_per_token": first.offline_s_per_token,
        "num_online_charged": first.num_online_charged,
        "num_online": first.num_online,
        "num_offline_in_mix": first.num_offline,
        "binding": first.binding,
        "kv_bound_tokens_per_s": first.kv_bound_tokens_per_s,
        "pacing_bound_tokens_per_s": first.pacing_bound_tokens_per_s,
        "paced_steps": first.paced_steps,
        "paced_gpu_s": first.paced_gpu_s,
        "mix_offline_qps": rate,
        "violation_pct_forgiven": violation_pct,
        "method": "docs/policies.md#how-far-from-the-hardware-the-offline-limit-simulated",
    }


def search_one(
    kind: str,
    cfg: ClusterConfig,
    policy: str,
    params: tuple[float, float, float, int],
    on_probe: Callable[[str, float, dict[str, Any]], None] | None = None,
) -> SearchResult:
    from tidal.sim.search import goodput, max_offline

    thr, start, stop, iters = params
    if kind == "max-offline":
        return max_offline(cfg, policy, thr, start, stop, int(iters), on_probe)
    return goodput(cfg, policy, thr, start, stop, int(iters), on_probe)


def probe_row(x: float, s: dict[str, Any]) -> dict[str, float]:
    return {
        "load": x,
        "violation_pct": s["online"]["violation_pct"],
        "slo_attainment_pct": s["online"]["slo_attainment_pct"],
        "offline_tokens_per_s": s["offline"]["tokens_per_s"],
        "offline_requests_per_s": s["offline"]["requests_per_s"],
        "goodput_rps": s["online"]["goodput_rps"],
        # Throughput in tokens processed (prompt + output of finished requests): HyGen §5.2's
        # "total throughput" against pure online serving.
        "online_total_tokens_per_s": s["online"]["total_tokens_per_s"],
        "offline_total_tokens_per_s": s["offline"]["total_tokens_per_s"],
        "online_tokens_per_s": s["online"]["tokens_per_s"],
        "tbt_mean_s": s["online"]["tbt_s"]["mean"],
        "ttft_p99_s": s["online"]["ttft_s"]["p99"],
    }
