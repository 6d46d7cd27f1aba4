"""The burst schedule in the discrete-event simulator: the same arrivals and jobs, the same
policy, the config's cluster with the live stack's resources (no CPU-attention worker, the batch
service's in-flight cap)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tidal.config.cluster import ClusterConfig
from tidal.policy.state import Phase
from tidal.sim.build import instance_setups, simulate
from tidal_bench.burst.schedule import BurstSchedule, OnlineResult, jobs_from_times


def sim_config(cfg: ClusterConfig, sched: BurstSchedule, job_timeout_s: float) -> ClusterConfig:
    """`cfg` for this run: the schedule's length, `job_timeout_s` of drain for the jobs, no
    CPU-attention worker (the live sim engine has no CPU-attention path) and the batch
    service's default in-flight cap (32 lines) unless the config sets one."""
    return dataclasses.replace(
        cfg,
        duration_s=sched.duration_s,
        drain_s=job_timeout_s,
        cpu_workers=dataclasses.replace(cfg.cpu_workers, count=0),
        batch_max_inflight=cfg.batch_max_inflight or 32,
    )


def kv_tokens_per_instance(cfg: ClusterConfig, policy: str) -> int:
    """The smallest instance KV pool of `policy` on `cfg`, in tokens (what the live stack's
    sim engine is given, so both sides hold the same KV)."""
    return min(s.num_blocks for s in instance_setups(cfg, policy)) * cfg.block_size


def run_simulated(
    cfg: ClusterConfig,
    policy: str,
    sched: BurstSchedule,
    seed: int,
    job_timeout_s: float,
    tick: Callable[[float], None] | None = None,
    online_offset_s: float = 0.0,
) -> dict[str, Any]:
    """Online results and job timelines, shaped as the live run's; `tick(t)` is told the
    simulated time as it goes; the online schedule starts `online_offset_s` after the jobs (as
    the live run's did)."""
    cfg = sim_config(cfg, sched, job_timeout_s)
    reqs = sched.sim_requests(seed, cfg.slo, online_offset_s)
    rec = simulate(cfg, policy, progress=tick, requests=reqs)
    online: list[OnlineResult] = []
    done: dict[str, float] = {}
    for r in rec.requests:
        if r.is_online:
            if r.phase is Phase.REJECTED:  # admission control's refusal: a 429 live
                online.append(OnlineResult(r.arrival_s - online_offset_s, "429"))
                continue
            ttft = None if r.first_token_s is None else r.first_token_s - r.arrival_s
            itl = None
            if r.phase is Phase.FINISHED and r.num_output_tokens > 1:
                assert r.first_token_s is not None and r.last_token_s is not None
                itl = (r.last_token_s - r.first_token_s) / (r.num_output_tokens - 1)
            online.append(OnlineResult(r.arrival_s - online_offset_s, "ok", ttft, itl))
        elif r.phase is Phase.FINISHED and r.finish_s is not None:
            done[r.req_id] = r.finish_s
    jobs = jobs_from_times(sched, 0.0, done)
    return {"online": online, "jobs": jobs, "online_offset_s": online_offset_s}
