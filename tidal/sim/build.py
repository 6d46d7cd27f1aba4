"""From a `ClusterConfig` to a finished run: latency models, instances, policy, workload."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

from tidal.config.cluster import ClusterConfig, StreamConfig
from tidal.perf.api import StepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import CpuPoolState, InstanceRole
from tidal.sim.classes import ClassGate
from tidal.sim.core import InstanceSetup, Simulator
from tidal.sim.models import CpuAttnRoofline
from tidal.sim.recorder import Recorder
from tidal.workload.mix import SimRequest, build_workload

_GB = 1e9


@functools.lru_cache(maxsize=32)
def _step_model(model: str, hardware: str, tp: int, kind: str, profile: str | None) -> StepModel:
    from tidal.perf import make_step_model  # lazy: perf is a sibling package

    return make_step_model(model, hardware, tp=tp, kind=kind, profile=profile)


def kv_geometry(cfg: ClusterConfig) -> tuple[float, int]:
    """(KV bytes per token on one GPU, KV blocks per instance)."""
    from tidal.perf import hardware_spec, kv_bytes_per_token, kv_capacity_tokens, model_spec

    m = model_spec(cfg.model)
    kvb = kv_bytes_per_token(m, cfg.tp)
    tokens = cfg.kv_capacity_tokens
    if tokens is None:
        tokens = kv_capacity_tokens(m, hardware_spec(cfg.hardware), cfg.tp, cfg.mem_fraction)
    blocks = tokens // cfg.block_size
    if blocks < 1:
        raise ValueError(f"{cfg.model} on {cfg.tp}x {cfg.hardware}: no memory left for KV")
    return kvb, blocks


def instance_setups(
    cfg: ClusterConfig, policy: str, step_model: StepModel | None = None
) -> list[InstanceSetup]:
    """One `InstanceSetup` per instance, for `policy` (its own instance list if it has one)."""
    kvb, blocks = kv_geometry(cfg)
    model = step_model or _step_model(
        cfg.model, cfg.hardware, cfg.tp, cfg.latency_model, cfg.profile
    )
    out: list[InstanceSetup] = []
    for g in cfg.groups_for(policy):
        for _ in range(g.count):
            out.append(
                InstanceSetup(
                    role=InstanceRole(g.role),
                    chunk_size=g.chunk_size,
                    num_blocks=blocks,
                    step_model=model,
                    kv_bytes_per_token=kvb,
                    block_size=cfg.block_size,
                    max_batch_reqs=g.max_batch_reqs,
                    pcie_bytes_per_s=cfg.pcie_gb_per_s * _GB,
                    ckpt_capacity_tokens=int(cfg.checkpoint_host_gb * _GB / (kvb * cfg.tp)),
                )
            )
    return out


def workload(cfg: ClusterConfig) -> list[SimRequest]:
    return build_workload(cfg.online, cfg.offline, cfg.duration_s, cfg.seed, cfg.slo)


def with_offline_rate(cfg: ClusterConfig, rate: float) -> ClusterConfig:
    """`cfg` with the offline stream at `rate` req/s (uniform QPS unless it says otherwise)."""
    if cfg.offline is None:
        raise ValueError("the config has no offline stream to vary")
    off = cfg.offline
    arrival = "uniform" if off.arrival == "trace" else off.arrival
    return replace(cfg, offline=replace(off, arrival=arrival, rate=rate, scale=None))


def with_online_rate(cfg: ClusterConfig, rate: float) -> ClusterConfig:
    """`cfg` with the online stream at mean `rate` req/s (trace: OOCO scaling)."""
    if cfg.online is None:
        raise ValueError("the config has no online stream to vary")
    return replace(cfg, online=replace(cfg.online, rate=rate, scale=None))


def policy_context(
    cfg: ClusterConfig, policy: str, setups: Sequence[InstanceSetup] | None = None
) -> PolicyContext:
    """What `policy` is built with on `cfg`'s cluster; `make_policy(policy, ctx)` checks its
    params (a clear error before any run)."""
    setups = instance_setups(cfg, policy) if setups is None else setups
    return PolicyContext(
        num_instances=len(setups),
        roles=tuple(s.role for s in setups),
        online_slo=cfg.slo,
        params=cfg.policy_params(policy),
        seed=cfg.seed,
    )


def simulate(
    cfg: ClusterConfig,
    policy: str,
    progress: Callable[[float], None] | None = None,
    step_model: StepModel | None = None,
    requests: Sequence[SimRequest] | None = None,
    check: bool = False,
    classes: ClassGate | None = None,
) -> Recorder:
    """Run `policy` on `cfg`'s cluster and workload; same config and seed, same result.
    `classes`: requests that name a request class run the gateway's class rule through it."""
    setups = instance_setups(cfg, policy, step_model)
    kvb = setups[0].kv_bytes_per_token
    cpu = None
    if cfg.cpu_workers.count > 0:
        cw = cfg.cpu_workers
        cpu = CpuPoolState(
            num_workers=cw.count,
            model=CpuAttnRoofline(
                kvb * cfg.tp, cw.gb_per_s_per_worker * _GB, cw.overhead_ms / 1000
            ),
            host_kv_capacity_tokens=int(cw.host_kv_gb * _GB / (kvb * cfg.tp)),
        )
    pol = make_policy(policy, policy_context(cfg, policy, setups))
    sim = Simulator(
        setups,
        pol,
        link_bytes_per_s=cfg.link_gb_per_s * _GB,
        link_latency_s=cfg.link_latency_ms / 1000,
        dispatch_s=cfg.dispatch_ms / 1000,
        dispatch_s_per_token=cfg.dispatch_us_per_token / 1e6,
        batch_max_inflight=cfg.batch_max_inflight,
        handoff_delay_s=cfg.handoff_delay_ms / 1000,
        handout_s=cfg.handout_ms / 1000,
        preempt_for_online=cfg.preempt_for_online,
        num_devices=cfg.num_devices,
        shared_device_slowdown=cfg.shared_device_slowdown,
        cpu=cpu,
        horizon_s=cfg.duration_s + cfg.drain_s,
        bin_s=cfg.bin_s,
        check=check,
        classes=classes,
    )
    return sim.run(workload(cfg) if requests is None else requests, progress)


__all__ = ["StreamConfig", "simulate", "with_offline_rate", "with_online_rate", "workload"]
