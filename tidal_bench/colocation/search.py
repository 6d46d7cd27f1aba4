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
flight included, and the devices the live engines share), run in-process and counted the same
way (`sim_side`). One live window is measured in `live_window`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from services.cli import natsd
from services.common import affinity
from tidal.config.cluster import ClusterConfig, parse_config, set_path
from tidal.configs import config_path
from tidal.sim.build import kv_geometry, with_offline_rate, workload
from tidal.workload.mix import SimRequest
from tidal_bench.colocation.caps import shares
from tidal_bench.colocation.live_window import measure_window
from tidal_bench.colocation.max_offline import (
    Measurement,
    Outcome,
    point_cpu,
    point_row,
    search_max_offline,
)
from tidal_bench.colocation.sim_side import at_loads, sim_config, simulated
from tidal_bench.kit import children_of, stack, up_pid


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
    sim_cfg = sim_config(args, cfg, policy)  # on the devices the live engines share
    sim = simulated(sim_cfg, policy, args, res["cpu_attn_workers_usable"])
    sim["at_live_probes"] = at_loads(sim_cfg, policy, args, res["cpu_attn_workers_usable"], out)
    sim["num_devices"] = sim_cfg.num_devices  # None: one device an instance
    sim["shared_device_slowdown"] = sim_cfg.shared_device_slowdown  # 1: a perfect time share
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
        entry["simulator_with_cpu_attn"] = simulated(sim_cfg, policy, args, cfg.cpu_workers.count)
    return entry


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
