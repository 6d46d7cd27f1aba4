"""The live search's caps, derived from the load instead of fixed, and each figure's share of the
computed offline limit (`tidal.sim.limit`; simulated).

- **Batch lines in flight** (`--batch-max-inflight`, default derived): as many lines as the
  instances' KV pools hold at once at the offline mix's mean footprint (prompt + output tokens),
  so the batch service's cap is never what saturates first: more lines could not all be resident.
- **The largest offline QPS** (`--max-qps`, default derived): the computed offline limit for the
  same config, window and resources (tokens/s) over the mix's mean output length, times a margin:
  a load no schedule could complete, so every policy saturates or misses the SLO at or below it.

- **Devices** (`engine_devices`): the torch engine's instances run on the cores
  `--engine-cores` names (all the host's if unpinned), and the fitted step profile prices one
  engine alone on one core: two instances pinned to one core have that core's seconds between
  them. So the limit is on min(instances, engine cores) devices, and the simulator beside the
  live run shares them too (`sim_side.sim_config`, `tidal.sim.sharing`): live and simulated
  figures are shares of one limit (`shares`).

The offline length mix is the config's offline stream drawn at `MIX_QPS` over the window (the
limit depends on the offline stream only through its mix). The limit rests on the roofline step
model; `limit_basis` says which model that is beside the engine's own step times.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from services.common import affinity
from tidal.config.cluster import ClusterConfig
from tidal.workload.mix import SimRequest

MIX_QPS = 64.0  # offline lines/s the length mix is drawn at (several hundred lines a window)
QPS_MARGIN = 1.5  # the derived --max-qps: this times the limit's lines/s


@dataclass(frozen=True)
class Mix:
    """The offline length mix: mean prompt and output tokens of a line."""

    lines: int
    mean_input_tokens: float
    mean_output_tokens: float


def offline_mix(cfg: ClusterConfig) -> Mix:
    """The config's offline lines over its window at `MIX_QPS` (lengths as the search offers)."""
    from tidal.sim.build import with_offline_rate, workload

    reqs: list[SimRequest] = workload(
        dataclasses.replace(with_offline_rate(cfg, MIX_QPS), online=None)
    )
    if not reqs:
        raise ValueError(f"{cfg.name}: the offline stream gives no lines in the window")
    n = len(reqs)
    return Mix(n, sum(r.input_tokens for r in reqs) / n, sum(r.output_tokens for r in reqs) / n)


def lines_in_flight(kv_tokens_total: int, mix: Mix) -> int:
    """Batch lines in flight that the KV pools (all instances, tokens) hold at the mix's mean
    footprint; at least 1."""
    if kv_tokens_total < 1:
        raise ValueError(f"KV capacity must be >= 1 token, got {kv_tokens_total}")
    return max(1, math.ceil(kv_tokens_total / (mix.mean_input_tokens + mix.mean_output_tokens)))


def max_qps_from_limit(limit_tokens_per_s: float, mix: Mix, margin: float = QPS_MARGIN) -> float:
    """Offline lines/s past the computed limit by `margin`, rounded up to a whole line/s."""
    if limit_tokens_per_s <= 0 or mix.mean_output_tokens <= 0:
        raise ValueError(
            f"cannot size the offline load from a limit of {limit_tokens_per_s:g} tok/s and "
            f"{mix.mean_output_tokens:g} output tokens a line: pass --max-qps"
        )
    return float(math.ceil(margin * limit_tokens_per_s / mix.mean_output_tokens))


def limit_basis(engine: str, sim_step_model: str, cfg: ClusterConfig) -> str:
    """What the limit is computed from, beside what the engine's step times are."""
    roofline = cfg.step_model_spec()
    if engine == "torch":
        if cfg.profile:
            return (
                f"derived from the config's roofline step model calibrated by {cfg.profile} "
                f"({roofline}): the engine's own steps only as far as that profile was fitted "
                f"to them"
            )
        return (
            f"derived from the config's roofline step model ({roofline}; a CPU roofline is "
            f"measured with numpy when first needed), not from the torch engine's own steps"
        )
    if sim_step_model == roofline:
        return (
            f"derived from the roofline step model the sim engine emulates ({roofline}): the "
            f"same step model on both sides"
        )
    return (
        f"derived from the config's roofline step model ({roofline}); the sim engine emulates "
        f"{sim_step_model}, a different step model"
    )


def window_limit(
    cfg: ClusterConfig,
    policy: str,
    violation_pct: float,
    workers: int,
    devices: int | None = None,
) -> Any:
    """`tidal.sim.limit.config_limit` for the window both sides run (warm-up included), the
    policy's instances and `workers` usable CPU-attention workers; the offline mix at MIX_QPS;
    the instances on `devices` devices (None: one each)."""
    from tidal.sim.limit import config_limit

    c = dataclasses.replace(cfg, cpu_workers=dataclasses.replace(cfg.cpu_workers, count=workers))
    return config_limit(c, policy, violation_pct, MIX_QPS, devices)


def engine_devices(
    engine: str, engine_cores: tuple[int, ...] | None, host_cores: int
) -> int | None:
    """The devices the live instances' engines share: None (one each) on the sim engine, whose
    steps are emulated per instance; on the torch engine the cores its engines may run on
    (`engine_cores`, or all `host_cores` when unpinned)."""
    if engine != "torch":
        return None
    return len(engine_cores) if engine_cores is not None else host_cores


def live_devices(args: argparse.Namespace) -> int | None:
    """`engine_devices` of the live stack `args` describe (`--engine`, `--engine-cores`)."""
    pinned = args.engine_cores
    cores = None if pinned is None else affinity.parse_cores(pinned, "--engine-cores")
    return engine_devices(args.engine, cores, os.cpu_count() or 1)


def shares(
    args: argparse.Namespace, cfg: ClusterConfig, policy: str, workers: int, entry: dict
) -> dict[str, Any]:
    """The live and simulated figures as shares of the computed offline limit (simulated) for
    the same config, window and resources, on the devices the live engines share
    (`live_devices`), which the simulator's instances share too (`sim_side.sim_config`); the
    limit's row, or why there is none."""
    devices = live_devices(args)
    basis = limit_basis(args.engine, args.sim_step_model, cfg)
    try:
        lim = window_limit(cfg, policy, args.violation, workers, devices)
    except ValueError as e:
        return {"limit": {"label": "simulated", "error": str(e)}}
    n = sum(g.count for g in cfg.groups_for(policy))
    where = "one device an instance"
    if devices is not None and devices < n:
        pinned = args.engine_cores
        at = f"engine cores {pinned}" if pinned is not None else "the host"
        where = f"{n} instances on {devices} core(s) ({at}), live and simulated"
    return {
        "limit": limit_row(lim, basis, where),
        "share_of_limit": lim.share(entry["max_offline_tokens_per_s"]),
        "sim_share_of_limit": lim.share(entry["sim_max_offline_tokens_per_s"]),
    }


def limit_row(lim: Any, basis: str, devices: str = "one device an instance") -> dict[str, Any]:
    """A limit's JSON entry (simulated: derived from the step model, not measured); `devices`
    says what the instances run on."""
    return {
        "label": "simulated",
        "basis": basis,
        "devices": devices,
        "tokens_per_s": lim.limit_tokens_per_s,
        "offline_only_tokens_per_s": lim.offline_only_tokens_per_s,
        "gpu_s": lim.gpu_s,
        "online_gpu_s": lim.online_gpu_s,
        "cpu_credit_s": lim.cpu_credit_s,
        "offline_s_per_token": lim.offline_s_per_token,
        "num_online_charged": lim.num_online_charged,
        "num_offline_in_mix": lim.num_offline,
        "binding": lim.binding,
        "kv_bound_tokens_per_s": lim.kv_bound_tokens_per_s,
        "pacing_bound_tokens_per_s": lim.pacing_bound_tokens_per_s,
        "paced_steps": lim.paced_steps,
        "paced_gpu_s": lim.paced_gpu_s,
        "mix_offline_qps": MIX_QPS,
    }


def derive(
    cfg: ClusterConfig,
    policies: list[str],
    engine: str,
    sim_step_model: str,
    violation_pct: float,
    workers: int,
    kv_tokens_per_instance: int,
    batch_max_inflight: int | None,
    max_qps: float | None,
) -> dict[str, Any]:
    """The caps every policy's search runs with (explicit values kept, the rest derived) and
    how each was reached. Equal for every policy: the largest any policy's instances need."""
    mix = offline_mix(cfg)
    out: dict[str, Any] = {
        "offline_mix": dataclasses.asdict(mix),
        "basis": limit_basis(engine, sim_step_model, cfg),
    }
    n = max(sum(g.count for g in cfg.groups_for(p)) for p in policies)
    if batch_max_inflight is None:
        batch_max_inflight = lines_in_flight(n * kv_tokens_per_instance, mix)
        out["batch_max_inflight_from"] = (
            f"{n} instances x {kv_tokens_per_instance} KV tokens / "
            f"{mix.mean_input_tokens + mix.mean_output_tokens:.0f} tokens a line (offline mix)"
        )
    else:
        out["batch_max_inflight_from"] = "--batch-max-inflight"
    if max_qps is None:
        try:
            lim = max(
                window_limit(cfg, p, violation_pct, workers).limit_tokens_per_s for p in policies
            )
        except ValueError as e:
            raise ValueError(f"--max-qps cannot be derived ({e}): pass --max-qps") from None
        max_qps = max_qps_from_limit(lim, mix)
        out["max_qps_from"] = (
            f"{QPS_MARGIN:g} x the offline limit {lim:.0f} tok/s (simulated) / "
            f"{mix.mean_output_tokens:.0f} output tokens a line, rounded up"
        )
    else:
        out["max_qps_from"] = "--max-qps"
    out["batch_max_inflight"] = batch_max_inflight
    out["max_qps"] = max_qps
    return out
