"""`tidal bench colocation --search-offline`: the live twin of `tidal sim max-offline` (OOCO §5.2).

Per policy, one `tidal up` stack with the same resources for every policy (the config's
instances, `--kv-cache-tokens` from the config, `--cpu-attn N` workers: a policy that cannot use
them leaves them idle); on it, `max_offline.search_max_offline` raises a uniform offline load,
submitted through the Batch API (`/v1/files` + `/v1/batches`, one batch a second holding the
lines that arrived in it), until the median online SLO attainment of `--repeats` windows falls
below 100 - `--violation` %. Each window replays the config's online trace stream (its scale,
from `--set online.start_s`) with the official openai client, streamed; its first `--warmup-s`
seconds are warm-up and are not counted (online requests arriving then, offline tokens completed
then). Offline lengths come from the config's offline stream, the same requests the simulator
offers at that QPS. Offline tokens/s is the growth of `tidal_batch_generated_tokens_total`
(tokens as they are generated) over the measured window. Beside each live figure: the
simulator's search on the same config, window and resources (the batch service's lines in
flight included), run in-process and counted the same way. One live window is measured in
`live_window`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from services.cli import natsd
from services.common import affinity
from tidal.config.cluster import ClusterConfig, parse_config, set_path
from tidal.configs import config_path
from tidal.sim.build import kv_geometry, with_offline_rate, workload
from tidal.workload.mix import SimRequest
from tidal_bench.colocation.caps import engine_devices, limit_basis, limit_row, window_limit
from tidal_bench.colocation.live_window import measure_window
from tidal_bench.colocation.max_offline import Measurement, Outcome, Point, search_max_offline
from tidal_bench.kit import children_of, pct, stack, up_pid


def write_config(args: argparse.Namespace, tmp: str) -> tuple[ClusterConfig, str]:
    """The config after `--set`, checked, and a YAML copy of it the live stack reads too (so the
    stack and the simulator run one config)."""
    data = yaml.safe_load(config_path(args.config).read_text()) or {}
    for a in args.set:
        try:
            set_path(data, a)
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"--set {a}: no such place in {args.config} ({e})") from e
    cfg = parse_config(data, args.config)
    if cfg.online is None or cfg.offline is None:
        raise ValueError(f"{args.config}: the search needs an online and an offline stream")
    cfg = dataclasses.replace(cfg, duration_s=args.warmup_s + args.measure_s)
    path = Path(tmp) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return cfg, str(path)


def resources(args: argparse.Namespace, cfg: ClusterConfig, policy: str, cpu_attn: int) -> dict:
    """What the stack of `policy` is given; the same for every policy but the CPU-attn variant."""
    _, blocks = kv_geometry(cfg)
    usable = cpu_attn if args.engine == "torch" else 0
    return {
        "engine": args.engine,
        "step_times": f"emulated {args.sim_step_model}" if args.engine == "sim" else "real",
        "instances": [
            {"role": g.role, "chunk_size": g.chunk_size, "count": g.count}
            for g in cfg.groups_for(policy)
        ],
        "kv_cache_tokens_per_instance": blocks * cfg.block_size,
        "cpu_attn_workers": cpu_attn,
        # NOTE: the sim engine has no CPU-attention path: its workers run but take no work
        "cpu_attn_workers_usable": usable,
        # the batch service runs this many lines at once, live and in the simulator
        # (`ClusterConfig.batch_max_inflight`); it caps the offline rate at high loads
        "batch_max_inflight": args.batch_max_inflight,
        "host_cores": os.cpu_count(),
        # NOTE: None = unpinned (every process on every core)
        "engine_cores": args.engine_cores,
        "cpu_attn_cores": args.cpu_attn_cores,
        "service_cores": args.service_cores,
    }


def up_args(args: argparse.Namespace, cfg_path: str, policy: str, res: dict) -> list[str]:
    up = ["--engine", args.engine, "--config", cfg_path, "--policy", policy]
    up += ["--cpu-attn", str(res["cpu_attn_workers"])]
    up += ["--kv-cache-tokens", str(res["kv_cache_tokens_per_instance"])]
    up += ["--batch-max-inflight", str(res["batch_max_inflight"])]
    for flag in ("engine_cores", "cpu_attn_cores", "service_cores"):
        if res[flag] is not None:
            up += ["--" + flag.replace("_", "-"), res[flag]]
    if args.engine == "sim":
        up += ["--sim-step-model", args.sim_step_model, "--max-model-len", str(args.max_model_len)]
    return up


def streams(cfg: ClusterConfig, qps: float) -> tuple[list[SimRequest], list[SimRequest]]:
    """The window's online requests (the same at every load) and its offline lines at `qps`."""
    online = [
        r for r in workload(dataclasses.replace(cfg, offline=None)) if r.arrival_s < cfg.duration_s
    ]
    if qps <= 0:
        return online, []
    off_cfg = dataclasses.replace(with_offline_rate(cfg, qps), online=None)
    return online, [r for r in workload(off_cfg) if r.arrival_s < cfg.duration_s]


def live_search(
    args: argparse.Namespace,
    cfg: ClusterConfig,
    base: str,
    model: str,
    on_window: Any,
    procs: dict[str, int] | None = None,
) -> Outcome:
    """The search on one running stack; `on_window(qps, repeat, measurement)` after each one;
    `procs` (name -> pid) have their CPU measured in every window."""

    def measure(qps: float) -> list[Measurement]:
        online, offline = streams(cfg, qps)
        runs = []
        for i in range(args.repeats):
            m = asyncio.run(
                measure_window(base, model, cfg, online, offline, args.warmup_s, procs=procs)
            )
            runs.append(m)
            on_window(qps, i, m)
        return runs

    return search_max_offline(
        measure, 100.0 - args.violation, args.start_qps, args.max_qps, args.iters
    )


def window_bin_s(warmup_s: float, end_s: float) -> float:
    """The widest time-series bin both the warm-up's end and the window's end fall on (whole
    milliseconds), so the simulator's per-bin token counts cover exactly the measured part."""
    ms = math.gcd(round(warmup_s * 1000), round(end_s * 1000))
    return max(ms, 1) / 1000


def sim_window(cfg: ClusterConfig, policy: str, qps: float, warmup_s: float) -> Measurement:
    """One simulated window, counted as the live one is: online requests arriving after the
    warm-up; offline tokens generated inside the measured part (a line still running or still
    waiting for a batch place at either end counts only what it generated inside); offline
    lines finishing inside it."""
    from tidal.policy.state import Phase
    from tidal.sim.build import simulate
    from tidal.sim.metrics import online_arrays

    c = with_offline_rate(cfg, qps) if qps > 0 else dataclasses.replace(cfg, offline=None)
    end_s, measured_s = cfg.duration_s, cfg.duration_s - warmup_s
    bin_s = window_bin_s(warmup_s, end_s)
    rec = simulate(dataclasses.replace(c, bin_s=bin_s), policy)
    reqs = rec.requests
    on = online_arrays(reqs)
    counted = on["arrival"] >= warmup_s
    done = [
        r
        for r in reqs
        if not r.is_online and r.phase is Phase.FINISHED and warmup_s <= (r.finish_s or 0.0) < end_s
    ]
    tokens = sum(rec.offline_tokens[round(warmup_s / bin_s) : round(end_s / bin_s)])
    ttft, tpot = on["ttft"][counted], on["tpot"][counted]
    return Measurement(
        attainment_pct=100.0 * float(on["ok"][counted].sum()) / max(1, int(counted.sum())),
        offline_tokens_per_s=tokens / measured_s,
        offline_lines_per_s=len(done) / measured_s,
        num_online=int(counted.sum()),
        ttft_p99_s=pct(ttft[~np.isnan(ttft)].tolist(), 99),
        tpot_p99_s=pct(tpot[~np.isnan(tpot)].tolist(), 99),
    )


def simulated(cfg: ClusterConfig, policy: str, args: argparse.Namespace, workers: int) -> dict:
    """The simulator (emulated) on the same config, window and resources: the same search over
    windows counted as the live ones (deterministic: one run a point), and beside it the
    simulator's own `max_offline` over the whole window (`tidal sim max-offline`)."""
    from tidal.sim.search import max_offline

    c = dataclasses.replace(
        cfg,
        cpu_workers=dataclasses.replace(cfg.cpu_workers, count=workers),
        batch_max_inflight=args.batch_max_inflight,
    )
    out = search_max_offline(
        lambda q: [sim_window(c, policy, q, args.warmup_s)],
        100.0 - args.violation,
        args.start_qps,
        args.max_qps,
        args.iters,
    )
    own = max_offline(c, policy, args.violation, args.start_qps, args.max_qps, args.iters)
    b = own.best or {}
    return {
        "max_offline_tokens_per_s": out.max_offline_tokens_per_s,
        "max_offline_qps": out.best.load_qps,
        "attainment_pct": out.best.attainment_pct,
        "saturated": out.saturated,
        "bound": out.bound,
        "bound_text": out.describe(),
        "probes": [point_row(p) for p in out.probes],
        "cpu_attn_workers": workers,
        "own_max_offline": {
            "what": "tidal sim max-offline on the whole window, warm-up included",
            "max_offline_tokens_per_s": b.get("offline", {}).get("tokens_per_s", 0.0),
            "max_offline_qps": own.best_rate,
            "attainment_pct": b.get("online", {}).get("slo_attainment_pct"),
            "saturated": own.saturated,
        },
    }


def point_row(p: Point) -> dict[str, Any]:
    return {
        "offline_qps": p.load_qps,
        "attainment_pct": p.attainment_pct,
        "attainment_median_pct": p.attainment_median_pct,
        "attainment_spread": p.spread("attainment_pct"),
        "offline_tokens_per_s": p.offline_tokens_per_s,
        "offline_tokens_per_s_spread": p.spread("offline_tokens_per_s"),
        "offline_lines_per_s": p.offline_lines_per_s,
        "cpu": point_cpu(p),
        "runs": [dataclasses.asdict(m) for m in p.runs],
    }


def at_loads(
    cfg: ClusterConfig, policy: str, args: argparse.Namespace, workers: int, out: Outcome
) -> list[dict[str, Any]]:
    """The simulator's window (emulated; same config, resources and lines in flight) at every
    load the live search probed, beside the live figure: live / simulator point by point."""
    c = dataclasses.replace(
        cfg,
        cpu_workers=dataclasses.replace(cfg.cpu_workers, count=workers),
        batch_max_inflight=args.batch_max_inflight,
    )
    rows = []
    for p in out.probes:
        if p.load_qps <= 0:
            continue
        m = sim_window(c, policy, p.load_qps, args.warmup_s)
        rows.append(
            {
                "offline_qps": p.load_qps,
                "live_offline_tokens_per_s": p.offline_tokens_per_s,
                "sim_offline_tokens_per_s": m.offline_tokens_per_s,
                "live_over_sim": (
                    p.offline_tokens_per_s / m.offline_tokens_per_s
                    if m.offline_tokens_per_s > 0
                    else None
                ),
                "live_attainment_pct": p.attainment_pct,
                "sim_attainment_pct": m.attainment_pct,
            }
        )
    return rows


def point_cpu(p: Point) -> dict[str, Any] | None:
    """The median over a point's windows of each process's CPU s/s, of their sum and of each
    core's busy share; None where no window measured CPU (the simulator's)."""
    rows = [m.cpu for m in p.runs if m.cpu]
    if not rows:
        return None

    def med(values: list[float]) -> float:
        return round(float(np.median(values)), 3)

    names = sorted({n for r in rows for n in r["cpu_s_per_s"]})
    cores = sorted({c for r in rows for c in r["core_busy"]})
    return {
        "cpu_s_per_s": {n: med([r["cpu_s_per_s"].get(n, 0.0) for r in rows]) for n in names},
        "stack_and_loadgen_cpu_s_per_s": med([r["stack_and_loadgen_cpu_s_per_s"] for r in rows]),
        "core_busy": {c: med([r["core_busy"].get(c, 0.0) for r in rows]) for c in cores},
        "loadavg_1m": med([r.get("loadavg_1m", float("nan")) for r in rows]),
    }


def run_policy(
    args: argparse.Namespace,
    cfg: ClusterConfig,
    cfg_path: str,
    policy: str,
    cpu_attn: int,
    prog: Any,
) -> dict[str, Any]:
    """Search one policy on its own stack; its JSON entry."""
    res = resources(args, cfg, policy, cpu_attn)
    task = prog.add_task(f"{policy} (cpu-attn {cpu_attn}): starting the stack", total=None)
    port = natsd.free_port()
    with stack(port, *up_args(args, cfg_path, policy, res)) as base:
        import openai

        model = openai.OpenAI(base_url=base, api_key="unused").models.list().data[0].id
        up = up_pid(port)
        procs = {**children_of(up), "tidal up": up, "load generator": os.getpid()}

        def on_window(qps: float, i: int, m: Measurement) -> None:
            prog.update(
                task,
                advance=1,
                description=f"{policy} (cpu-attn {cpu_attn}): {qps:g} QPS repeat {i + 1}/"
                f"{args.repeats}: {m.attainment_pct:.1f}% attained, "
                f"{m.offline_tokens_per_s:.0f} offline tok/s",
            )

        with on_cores(args.service_cores):  # the load generator beside the control plane
            out = live_search(args, cfg, base, model, on_window, procs)
    prog.update(task, description=f"{policy} (cpu-attn {cpu_attn}): simulating")
    sim = simulated(cfg, policy, args, res["cpu_attn_workers_usable"])
    sim["at_live_probes"] = at_loads(cfg, policy, args, res["cpu_attn_workers_usable"], out)
    prog.update(task, description=f"{policy} (cpu-attn {cpu_attn}): done")
    best = out.best
    entry: dict[str, Any] = {
        "max_offline_tokens_per_s": out.max_offline_tokens_per_s,
        "max_offline_qps": best.load_qps,
        "attainment": best.attainment_pct,
        "attainment_median": best.attainment_median_pct,
        "spread": {
            "attainment_pct": best.spread("attainment_pct"),
            "offline_tokens_per_s": best.spread("offline_tokens_per_s"),
        },
        "saturated": out.saturated,
        "bound": out.bound,
        "bound_text": out.describe(),
        "failed_at_qps": out.failed_at,
        "cpu": point_cpu(best),
        "sim_max_offline_tokens_per_s": sim["max_offline_tokens_per_s"],
        "simulator": sim,
        "resources": res,
        "probes": [point_row(p) for p in out.probes],
    }
    entry.update(shares(args, cfg, policy, res["cpu_attn_workers_usable"], entry))
    if args.engine == "sim" and cfg.cpu_workers.count > 0 and policy in args.without_cpu_attn:
        # the live sim engine cannot offload attention; what the simulator's worker adds
        entry["simulator_with_cpu_attn"] = simulated(cfg, policy, args, cfg.cpu_workers.count)
    return entry


def shares(
    args: argparse.Namespace, cfg: ClusterConfig, policy: str, workers: int, entry: dict
) -> dict[str, Any]:
    """The live and simulated figures as shares of the computed offline limit (simulated) for
    the same config, window and resources; the limit's row, or why there is none. The live
    share is of the limit on the devices the live engines share (`caps.engine_devices`); the
    simulator's of the limit on one device an instance, as it runs them; `sim_limit` is that one
    where the two differ."""
    pinned = args.engine_cores
    cores = None if pinned is None else affinity.parse_cores(pinned, "--engine-cores")
    devices = engine_devices(args.engine, cores, os.cpu_count() or 1)
    basis = limit_basis(args.engine, args.sim_step_model, cfg)
    try:
        own = window_limit(cfg, policy, args.violation, workers)
        lim = window_limit(cfg, policy, args.violation, workers, devices)
    except ValueError as e:
        return {"limit": {"label": "simulated", "error": str(e)}}
    n = sum(g.count for g in cfg.groups_for(policy))
    if devices is None or devices >= n:
        return {
            "limit": limit_row(lim, basis),
            "share_of_limit": lim.share(entry["max_offline_tokens_per_s"]),
            "sim_share_of_limit": own.share(entry["sim_max_offline_tokens_per_s"]),
        }
    where = f"engine cores {pinned}" if pinned is not None else "the host"
    return {
        "limit": limit_row(lim, basis, f"{n} instances on {devices} core(s) ({where})"),
        "share_of_limit": lim.share(entry["max_offline_tokens_per_s"]),
        "sim_limit": limit_row(own, basis, "one device an instance, as the simulator runs them"),
        "sim_share_of_limit": own.share(entry["sim_max_offline_tokens_per_s"]),
    }


@contextlib.contextmanager
def on_cores(spec: str | None) -> Iterator[None]:
    """This process (its threads from now on) on `spec`'s cores, then back where it was; the
    stack is started before, so its processes do not inherit the mask."""
    if spec is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, affinity.parse_cores(spec, "--service-cores"))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def variants(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(report name, policy, CPU-attn workers) of every stack to search."""
    out = [(p, p, args.cpu_attn) for p in args.policies]
    if args.engine == "torch" and args.cpu_attn > 0:
        out += [(f"{p}/no-cpu-attn", p, 0) for p in args.policies if p in args.without_cpu_attn]
    return out


def temp_dir() -> str:
    return tempfile.mkdtemp(prefix="tidal-colo-")
