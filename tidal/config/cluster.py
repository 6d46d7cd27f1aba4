"""The cluster configuration: YAML parsed into frozen dataclasses, every range checked. The
simulator, the live services (`tidal.config.live`) and the policies all read it.

One file describes a whole experiment: the node (model, accelerator, TP, instances with roles and
chunk sizes, links, CPU-attention workers), the workload (online and offline streams) and the
online SLO; ``policies`` holds each policy's own section (passed to it as `PolicyContext.params`)
and may give a policy its own ``instances`` list (e.g. P/D disaggregation needs P and D roles).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tidal.config.classes import ClassTable, default_table, parse_classes
from tidal.config.tolerance import Tolerance
from tidal.configs import config_path
from tidal.policy.state import InstanceRole, Slo
from tidal.workload.mix import StreamConfig

_T = TypeVar("_T")


def build(cls: type[_T], data: Any, where: str) -> _T:
    """`cls(**data)` with a message naming the file section on unknown keys or bad values."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


@dataclass(frozen=True)
class InstanceGroup:
    """`count` identical instances."""

    role: str  # aggregated | prefill | decode | relaxed | strict | p-heavy | d-heavy
    chunk_size: int = 512  # token budget per step
    count: int = 1
    max_batch_reqs: int = 256  # most requests in one step

    def __post_init__(self) -> None:
        roles = [r.value for r in InstanceRole]
        if self.role not in roles:
            raise ValueError(f"role must be one of {roles}, got {self.role!r}")
        if self.chunk_size < 1 or self.count < 1 or self.max_batch_reqs < 1:
            raise ValueError("chunk_size, count and max_batch_reqs must be >= 1")


@dataclass(frozen=True)
class CpuWorkers:
    """CPU-attention workers on the host (OmniServe §3.2)."""

    count: int = 0  # 0 = none
    gb_per_s_per_worker: float = 100.0  # sustained memory bandwidth of one worker, GB/s
    overhead_ms: float = 2.0  # fixed cost per CPU-attention step
    host_kv_gb: float = 512.0  # host memory for offloaded / swapped KV, GB

    def __post_init__(self) -> None:
        if self.count < 0 or self.gb_per_s_per_worker <= 0 or self.overhead_ms < 0:
            raise ValueError("count >= 0, gb_per_s_per_worker > 0, overhead_ms >= 0")
        if self.host_kv_gb < 0:
            raise ValueError(f"host_kv_gb must be >= 0, got {self.host_kv_gb}")


@dataclass(frozen=True)
class ClusterConfig:
    """A whole experiment: the cluster, its workload and SLOs (simulated or live)."""

    name: str
    model: str  # catalogue name, e.g. qwen2.5-7b (tidal.perf.catalog)
    hardware: str  # catalogue name, e.g. a100-80gb
    instances: tuple[InstanceGroup, ...]
    slo: Slo  # online TTFT / TPOT targets
    online: StreamConfig | None = None
    offline: StreamConfig | None = None
    policy: str = "aggregated"  # default for `tidal sim run`
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> params
    slo_variants: Mapping[str, Slo] = field(default_factory=dict)  # e.g. TaiChi SLO1 / SLO2
    # HyGen §5.2's SLOs: tolerances on one aggregate online metric over pure online serving
    # (`tidal.config.tolerance`), judged by `tidal sim tolerance`; the per-request `slo` is not
    slo_tolerances: tuple[Tolerance, ...] = ()
    description: str = ""
    tp: int = 1  # tensor parallel GPUs per instance
    latency_model: str = "roofline"  # roofline | regression | modulewise (tidal.perf)
    profile: str | None = None  # calibration profile for the latency model
    mem_fraction: float = 0.9  # of GPU memory for weights + KV
    block_size: int = 16  # tokens per KV block
    kv_capacity_tokens: int | None = None  # per instance; None = from memory and weights
    link_gb_per_s: float = 25.0  # instance <-> instance KV transfer bandwidth, GB/s
    link_latency_ms: float = 0.5  # fixed cost of one KV transfer
    # The serving path in front of the scheduler (HTTP, gateway, bus hops, tokenising): a request
    # is routed dispatch_ms + dispatch_us_per_token * prompt tokens after it arrives (0: at once).
    dispatch_ms: float = 0.0
    dispatch_us_per_token: float = 0.0
    # Of link_latency_ms, the part before a prefill's push reaches its source (the live
    # scheduler's report -> tick -> command); the source then exports it between its steps.
    handoff_delay_ms: float = 0.0
    # A held (offline) request the cluster's tick dispatches to an idle instance starts there
    # this much later: the live hand-out (report, scheduler tick and reply, the Batch API
    # service's submit, the instance's next loop; docs/colocation.md). 0: at once.
    handout_ms: float = 0.0
    pcie_gb_per_s: float = 25.0  # GPU <-> host copies (swap, offload), GB/s
    checkpoint_host_gb: float = 0.0  # per instance: host memory for offline KV checkpoints
    # (ConServe; `StepPlan.checkpoint`), GB; 0: none, and plans asking for them are refused
    # An online request that no instance has the KV blocks free for preempts offline work on the
    # instance with the most of it and goes there (`tidal.policy.preempt.room_for_online`; live,
    # the scheduler's `tidal.inst.<id>.preempt` signal). Off: the policy's route stands.
    preempt_for_online: bool = False
    cpu_workers: CpuWorkers = CpuWorkers()
    # The instances share this many devices (the live torch engines pinned to fewer cores than
    # instances, `--engine-cores`): in the simulator their steps run under processor sharing
    # (`tidal.sim.sharing`), in the offline limit they have these devices' seconds between them
    # (`tidal.sim.limit`). None: each instance has its own.
    num_devices: int | None = None
    # While more steps than `num_devices` are in flight, each runs at (D / k) / this: the work a
    # step does beside another on its device over its work alone (1: perfect time sharing).
    shared_device_slowdown: float = 1.0
    # Offline requests are Batch API lines: at most this many in the cluster at once, the rest
    # wait FIFO (the live batch service's `tidal up --batch-max-inflight`); None = no cap.
    batch_max_inflight: int | None = None
    duration_s: float = 600.0  # arrivals in [0, duration_s)
    drain_s: float = 300.0  # simulated time after the last arrival for requests to finish
    bin_s: float = 10.0  # width of the time series bins
    seed: int = 0
    # Request classes (`tidal.config.classes`): `classes`, `default_class` and `class_keys` in
    # the file; without them the built-in pair, online (this config's `slo`) and offline.
    classes: ClassTable = field(default_factory=default_table)

    def __post_init__(self) -> None:
        if not self.instances:
            raise ValueError("instances: at least one instance group is needed")
        if self.tp < 1 or self.block_size < 1:
            raise ValueError("tp and block_size must be >= 1")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")
        if self.checkpoint_host_gb < 0:
            raise ValueError(f"checkpoint_host_gb must be >= 0, got {self.checkpoint_host_gb}")
        if self.link_gb_per_s <= 0 or self.pcie_gb_per_s <= 0 or self.link_latency_ms < 0:
            raise ValueError("link_gb_per_s and pcie_gb_per_s must be > 0, latency >= 0")
        if self.dispatch_ms < 0 or self.dispatch_us_per_token < 0:
            raise ValueError("dispatch_ms and dispatch_us_per_token must be >= 0")
        if self.handout_ms < 0:
            raise ValueError(f"handout_ms must be >= 0, got {self.handout_ms}")
        if not 0 <= self.handoff_delay_ms <= self.link_latency_ms:
            raise ValueError("handoff_delay_ms must be in [0, link_latency_ms] (a part of it)")
        if self.duration_s <= 0 or self.drain_s < 0 or self.bin_s <= 0:
            raise ValueError("duration_s and bin_s must be > 0, drain_s >= 0")
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.shared_device_slowdown < 1.0:
            raise ValueError(
                f"shared_device_slowdown must be >= 1, got {self.shared_device_slowdown}"
            )
        if self.batch_max_inflight is not None and self.batch_max_inflight < 1:
            raise ValueError(f"batch_max_inflight must be >= 1, got {self.batch_max_inflight}")
        if self.online is None and self.offline is None:
            raise ValueError("give an online stream, an offline stream or both")

    def policy_params(self, name: str) -> dict[str, Any]:
        """The policy's own section, without the simulator's `instances` override."""
        p = dict(self.policies.get(name, {}))
        p.pop("instances", None)
        return p

    def groups_for(self, name: str) -> tuple[InstanceGroup, ...]:
        """Instance groups for policy `name` (its own `instances` list if it has one)."""
        raw = self.policies.get(name, {}).get("instances")
        if raw is None:
            return self.instances
        return tuple(
            build(InstanceGroup, g, f"policies.{name}.instances[{i}]") for i, g in enumerate(raw)
        )

    def step_model_spec(self, model: str | None = None) -> str:
        """This config's step model as a live sim-engine instance is told it
        (`--sim-step-model`, `tidal.perf.spec`): model (or `model`), hardware, tp, latency
        model and profile, the same the simulator builds."""
        from tidal.perf.spec import StepModelSpec  # lazy: perf is a sibling package

        m = model or self.model
        return str(StepModelSpec(m, self.hardware, self.tp, self.latency_model, self.profile))

    def with_slo(self, variant: str) -> ClusterConfig:
        if variant not in self.slo_variants:
            raise ValueError(f"unknown SLO {variant!r}; config has {sorted(self.slo_variants)}")
        return replace(self, slo=self.slo_variants[variant])


def parse_config(data: Mapping[str, Any], where: str = "config") -> ClusterConfig:
    """A `ClusterConfig` from a YAML mapping."""
    d = dict(data)
    if "instances" not in d or not isinstance(d["instances"], list):
        raise ValueError(f"{where}: 'instances' must be a list of instance groups")
    d["instances"] = tuple(
        build(InstanceGroup, g, f"{where}.instances[{i}]") for i, g in enumerate(d["instances"])
    )
    if "slo" not in d:
        raise ValueError(f"{where}: 'slo' (ttft_s, tpot_s) is required")
    d["slo"] = build(Slo, d["slo"], f"{where}.slo")
    d["slo_variants"] = {
        k: build(Slo, v, f"{where}.slo_variants.{k}")
        for k, v in (d.get("slo_variants") or {}).items()
    }
    tols = d.get("slo_tolerances") or []
    if not isinstance(tols, list):
        raise ValueError(f"{where}.slo_tolerances: expected a list of {{metric, ratio}}")
    d["slo_tolerances"] = tuple(
        build(Tolerance, t, f"{where}.slo_tolerances[{i}]") for i, t in enumerate(tols)
    )
    for k in ("online", "offline"):
        if d.get(k) is not None:
            d[k] = build(StreamConfig, d[k], f"{where}.{k}")
    if "cpu_workers" in d:
        d["cpu_workers"] = build(CpuWorkers, d["cpu_workers"] or {}, f"{where}.cpu_workers")
    d["policies"] = {str(k): dict(v or {}) for k, v in (d.get("policies") or {}).items()}
    d["classes"] = parse_classes(
        d.pop("classes", None), d.pop("default_class", None), d.pop("class_keys", None), where
    )
    return build(ClusterConfig, d, where)


def set_path(data: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b[0].c=value`` (value parsed as YAML) to the raw config mapping in place."""
    if "=" not in assignment:
        raise ValueError(f"--set expects key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    value = yaml.safe_load(raw)
    parts: list[str | int] = []
    for part in key.strip().split("."):
        name, *idx = part.replace("]", "").split("[")
        if name:
            parts.append(name)
        parts += [int(i) for i in idx]
    node: Any = data
    for p in parts[:-1]:
        if isinstance(p, int):
            node = node[p]
        else:
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
    node[parts[-1]] = value


def load_config(path: str | Path, overrides: tuple[str, ...] = ()) -> ClusterConfig:
    """Read and check a YAML config file, after ``key=value`` overrides (`set_path`). A path
    that does not exist may name a shipped config (`tidal.configs.config_path`)."""
    p = config_path(path)
    with p.open() as f:
        data = yaml.safe_load(f) or {}
    for a in overrides:
        try:
            set_path(data, a)
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"--set {a}: no such place in {p} ({e})") from e
    return parse_config(data, str(p))


def override_streams(
    cfg: ClusterConfig,
    online_trace: str | None = None,
    offline_lengths: str | None = None,
    seed: int | None = None,
    duration_s: float | None = None,
) -> ClusterConfig:
    """The command-line replacements every `tidal sim` command accepts."""
    if online_trace is not None:
        base = cfg.online or StreamConfig(online_trace)
        cfg = replace(cfg, online=replace(base, source=online_trace))
    if offline_lengths is not None:
        base = cfg.offline or StreamConfig(offline_lengths, arrival="uniform", rate=1.0)
        arrival = "uniform" if base.arrival == "trace" else base.arrival
        rate = base.rate if base.rate is not None else 1.0
        cfg = replace(
            cfg,
            offline=replace(base, source=offline_lengths, arrival=arrival, rate=rate, scale=None),
        )
    if seed is not None:
        cfg = replace(cfg, seed=seed)
    if duration_s is not None:
        cfg = replace(cfg, duration_s=duration_s)
    return cfg
