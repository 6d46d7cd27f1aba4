"""The simulator's side of `tidal bench colocation --search-offline` (simulated): the same
config, window and resources as the live stack, counted as the live windows are.

The simulator's instances share the devices the live engines share (`sim_config`): the torch
engines pinned to fewer cores than instances (`--engine-cores 0` runs both on core 0) step
under processor sharing there (`tidal.sim.sharing`), as the OS runs them; the step profile
prices one engine alone on one core. Each shared step also does more work than alone (caches
and memory bandwidth shared): the factor measured on the profile's host, stored with the
profile (`shared_device_slowdown`, `profile_slowdown`), becomes the simulator's
`shared_device_slowdown`; the bench never measures it at run time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import numpy as np

from tidal.config.cluster import ClusterConfig
from tidal.sim.build import with_offline_rate
from tidal_bench.colocation.caps import live_devices
from tidal_bench.colocation.max_offline import Measurement, Outcome, point_row, search_max_offline
from tidal_bench.kit import pct


def sim_config(args: argparse.Namespace, cfg: ClusterConfig, policy: str) -> ClusterConfig:
    """`cfg` as the simulator beside `policy`'s live stack runs it: its instances on the
    devices the live engines share (`caps.live_devices`) where those are fewer than the
    instances, each shared step slowed by the factor stored with the config's step profile
    (`profile_slowdown`); a `num_devices` the config sets itself stands."""
    devices = live_devices(args)
    n = sum(g.count for g in cfg.groups_for(policy))
    if cfg.num_devices is not None or devices is None or devices >= n:
        return cfg
    slowdown = cfg.shared_device_slowdown
    if slowdown == 1.0:  # the config's own (other than the default) stands
        slowdown = profile_slowdown(cfg.profile)
    return dataclasses.replace(cfg, num_devices=devices, shared_device_slowdown=slowdown)


def profile_slowdown(profile: str | None) -> float:
    """The contention factor stored with a step profile (its `shared_device_slowdown.factor`:
    two engines stepping on one core, each step's time over twice its time alone, measured by
    `python -m tidal_bench.colocation.shared_core` on the host the profile was fitted on);
    1 where the profile has none (or there is no profile)."""
    if not profile:
        return 1.0
    from tidal.perf.profile import load_profile

    entry = load_profile(profile).get("shared_device_slowdown")
    if entry is None:
        return 1.0
    factor = float(entry["factor"])
    if factor < 1.0:
        raise ValueError(f"{profile}: shared_device_slowdown.factor must be >= 1, got {factor}")
    return factor


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
