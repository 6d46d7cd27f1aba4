"""The instance half of a policy, live: mirror the engine into an `InstanceState`, ask the
policy's `schedule(inst, now)` for the next `StepPlan`, and describe the instance in an
`InstanceReport` for the scheduler.

`now` and every time in the mirrored `ReqState`s are wall-clock Unix seconds. Each step's
measured time against what the step model predicted for its plan gives the policy
`InstanceState.step_time_scale` (`tidal.perf.step_scale`: engines sharing cores run slower than
the profile fitted to one alone). What a simulator
knows and a live system does not is given as a live system knows it: a request's output length
is its `max_tokens` (the policy's `ReqState.max_output_tokens`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.cluster.view import report_of, sync_instance
from tidal.engine.api import SeqSnapshot
from tidal.perf.api import StepModel
from tidal.perf.step_scale import StepTimeScale
from tidal.policy.base import Policy, StepPlan
from tidal.policy.class_preempt import class_preemption
from tidal.policy.plan_builder import plan_shape
from tidal.policy.state import CpuPoolState, InstanceRole, InstanceState, ReqState, Slo
from tidal.schemas.messages import InstanceReport
from tidal.sim.models import CpuAttnRoofline


@dataclass
class ReqMeta:
    """What the instance knows of a request beyond its engine: SLO and token times."""

    slo: Slo | None
    arrival_unix_s: float
    start_unix_s: float | None = None
    first_token_unix_s: float | None = None
    last_token_unix_s: float | None = None
    max_tbt_s: float = 0.0
    num_preemptions: int = 0
    num_migrations: int = 0


@dataclass
class PolicyAdapter:
    policy: Policy
    inst: InstanceState
    step_model_spec: str
    instance_id: str
    meta: dict[str, ReqMeta] = field(default_factory=dict)  # req_id -> what the engine lacks
    reqs: dict[str, ReqState] = field(default_factory=dict)  # mirrored, reused across steps
    num_reserved_blocks: int = 0  # held for incoming migrations (not the policy's to plan)
    num_incoming: int = 0
    forced: dict[str, int] = field(default_factory=dict)  # req_id -> tokens its cut chunk needs
    # (live CPU-attention workers, KV bytes free on them), when the engine can offload
    cpu_capacity: Callable[[], tuple[int, int]] | None = None
    # host bytes for offline KV checkpoints in all, when the engine keeps them (ConServe)
    checkpoint_capacity: Callable[[], int] | None = None
    step_scale: StepTimeScale = field(default_factory=StepTimeScale)
    predicted_s: float = 0.0  # the step model's time for the last plan (0: none computes)

    @staticmethod
    def build(
        policy: Policy,
        index: int,
        instance_id: str,
        role: str,
        chunk_size: int,
        max_batch_reqs: int,
        block_size: int,
        num_blocks: int,
        step_model: StepModel,
        step_model_spec: str,
        kv_bytes_per_token: float,
    ) -> PolicyAdapter:
        inst = InstanceState(
            instance_id=index,
            role=InstanceRole(role),
            chunk_size=chunk_size,
            max_batch_reqs=max_batch_reqs,
            block_size=block_size,
            num_blocks=num_blocks,
            num_free_blocks=num_blocks,
            step_model=step_model,
            kv_bytes_per_token=kv_bytes_per_token,
            pcie_bytes_per_s=25e9,
        )
        return PolicyAdapter(policy, inst, step_model_spec, instance_id)

    # ---- engine -> InstanceState ----

    def sync(self, snaps: list[SeqSnapshot], num_free_blocks: int, now: float) -> None:
        """Mirror the engine's requests into `inst` (`tidal.cluster.view.sync_instance`; blocks
        reserved for incoming migrations are not the policy's to plan), then the times and
        counters only this instance knows."""
        slos = {rid: m.slo for rid, m in self.meta.items()}
        free = max(0, num_free_blocks - self.num_reserved_blocks)
        sync_instance(self.inst, snaps, self.reqs, free, slos=slos, now=now)
        self.inst.num_incoming = self.num_incoming
        self.inst.cpu = self._cpu_pool()
        self._checkpoint_memory()
        self.forced = {s.req_id: s.forced_tokens for s in snaps if s.forced_tokens}
        for rid, r in self.reqs.items():
            m = self.meta.get(rid)
            if m is None:
                continue
            r.start_s = m.start_unix_s
            r.first_token_s = m.first_token_unix_s
            r.last_token_s = m.last_token_unix_s
            r.max_tbt_s = m.max_tbt_s
            r.num_preemptions = m.num_preemptions
            r.num_migrations = m.num_migrations

    def _checkpoint_memory(self) -> None:
        """The checkpoint budget in tokens, and the tokens its requests hold (so the policy's
        arithmetic matches the engine's: `int(tokens * bytes per token)` each)."""
        inst = self.inst
        if self.checkpoint_capacity is None:
            inst.ckpt_capacity_tokens = inst.ckpt_tokens = 0
            return
        inst.ckpt_capacity_tokens = int(self.checkpoint_capacity() // inst.kv_bytes_per_token)
        held = (*inst.running, *inst.swapped, *inst.waiting, *inst.offloaded)
        inst.ckpt_tokens = sum(r.num_checkpointed_tokens for r in held)

    def _cpu_pool(self) -> CpuPoolState | None:
        """The CPU-attention workers as a policy sees them (None: none are live). Live, an
        offloaded request's token is in flight until its outputs are back, which the engine
        tracks itself, so the pool is never `busy_until` a time; the host room is what the
        workers say is free."""
        if self.cpu_capacity is None:
            return None
        num_workers, free_bytes = self.cpu_capacity()
        if num_workers == 0:
            return None
        per_token = self.inst.kv_bytes_per_token
        return CpuPoolState(
            num_workers=num_workers,
            model=CpuAttnRoofline(kv_bytes_per_token=per_token),
            host_kv_capacity_tokens=max(1, int(free_bytes // per_token)),
        )

    def plan(self, now: float) -> StepPlan:
        """The next step: first the evictions the higher classes here need (an eviction
        plan with no compute; the next call plans the step), else the policy's plan. The
        rule is the simulator's (`tidal.policy.class_preempt`)."""
        pre = class_preemption(self.inst)
        plan = pre.plan if pre is not None else self.policy.schedule(self.inst, now)
        computes = plan.prefill or plan.decode
        self.predicted_s = (
            self.inst.step_model.step_s(plan_shape(self.inst, plan)) if computes else 0.0
        )
        return plan

    # ---- tokens -> metadata ----

    def on_tokens(self, req_id: str, now: float, num_tokens: int) -> None:
        m = self.meta.get(req_id)
        if m is None or num_tokens <= 0:
            return
        if m.first_token_unix_s is None:
            m.first_token_unix_s = now
        elif m.last_token_unix_s is not None:
            m.max_tbt_s = max(m.max_tbt_s, now - m.last_token_unix_s)
        m.last_token_unix_s = now

    def on_step_end(self, measured_s: float) -> None:
        """A step of the last plan ran for `measured_s` (whole: not cut at a layer): the
        policy's `step_time_scale` follows it."""
        self.step_scale.observe(self.predicted_s, measured_s)
        self.inst.step_time_scale = self.step_scale.value

    def on_step_start(self, plan: StepPlan, now: float) -> None:
        for rid in plan.prefill:
            m = self.meta.get(rid)
            if m is not None and m.start_unix_s is None:
                m.start_unix_s = now
        for rid in plan.evicts:
            m = self.meta.get(rid)
            if m is not None:
                m.num_preemptions += 1

    # ---- InstanceState -> report ----

    def report(self, seq: int, data_url: str, **extra: Any) -> InstanceReport:
        return report_of(
            self.inst,
            self.instance_id,
            time.time(),
            seq,
            step_model=self.step_model_spec,
            data_url=data_url,
            policy=self.policy.name,
            **extra,
        )
