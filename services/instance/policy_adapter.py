"""The instance half of a policy, live: mirror the engine into an `InstanceState`, ask the
policy's `schedule(inst, now)` for the next `StepPlan`, and describe the instance in an
`InstanceReport` for the scheduler.

`now` and every time in the mirrored `ReqState`s are wall-clock Unix seconds. What a simulator
knows and a live system does not is given as a live system knows it: a request's output length
is its `max_tokens` (the policy's `ReqState.max_output_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tidal.engine.api import SeqSnapshot
from tidal.perf.api import StepModel
from tidal.policy.base import (
    InstanceRole,
    InstanceState,
    Phase,
    Policy,
    ReqState,
    Slo,
    StepPlan,
)
from tidal.schemas.enums import RequestClass
from tidal.schemas.messages import InstanceReport, ReqReport

_PHASE = {"waiting": Phase.WAITING, "running": Phase.RUNNING, "swapped": Phase.SWAPPED}


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
        """Mirror the engine's requests into `inst` (ReqState objects are reused by req_id:
        policies key their bookkeeping by it)."""
        inst = self.inst
        inst.waiting, inst.running, inst.swapped = [], [], []
        live: dict[str, ReqState] = {}
        self.forced = {}
        num_waiting_tokens = 0
        for s in snaps:
            r = self.reqs.get(s.req_id) or self._new_state(s, now)
            m = self.meta.get(s.req_id)
            r.num_computed_tokens = s.num_computed_tokens
            r.num_output_tokens = s.num_output_tokens
            r.num_blocks = s.num_blocks
            r.phase = _PHASE.get(s.status, Phase.WAITING)
            r.instance_id = inst.instance_id
            if m is not None:
                r.start_s = m.start_unix_s
                r.first_token_s = m.first_token_unix_s
                r.last_token_s = m.last_token_unix_s
                r.max_tbt_s = m.max_tbt_s
                r.num_preemptions = m.num_preemptions
                r.num_migrations = m.num_migrations
            if s.forced_tokens:
                self.forced[s.req_id] = s.forced_tokens
            live[s.req_id] = r
            if r.phase is Phase.WAITING:
                inst.waiting.append(r)
                num_waiting_tokens += r.num_prefill_left
            elif r.phase is Phase.RUNNING:
                inst.running.append(r)
            else:
                inst.swapped.append(r)
        self.reqs = live
        inst.num_waiting_tokens = num_waiting_tokens
        inst.num_free_blocks = max(0, num_free_blocks - self.num_reserved_blocks)
        inst.num_incoming = self.num_incoming

    def _new_state(self, s: SeqSnapshot, now: float) -> ReqState:
        m = self.meta.get(s.req_id)
        return ReqState(
            req_id=s.req_id,
            req_class=RequestClass(s.req_class),
            arrival_s=m.arrival_unix_s if m else now,
            num_prompt_tokens=s.num_prompt_tokens,
            max_output_tokens=s.max_output_tokens,
            slo=m.slo if m else None,
            queued_s=now,
        )

    def plan(self, now: float) -> StepPlan:
        self.inst.busy_until_s = 0.0
        return self.policy.schedule(self.inst, now)

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

    def on_step_start(self, plan: StepPlan, now: float) -> None:
        for rid in plan.prefill:
            m = self.meta.get(rid)
            if m is not None and m.start_unix_s is None:
                m.start_unix_s = now
        for rid in plan.preempt:
            m = self.meta.get(rid)
            if m is not None:
                m.num_preemptions += 1

    # ---- InstanceState -> report ----

    def report(self, seq: int, data_url: str, **extra: object) -> InstanceReport:
        inst = self.inst
        reqs = [
            _req_report(r)
            for lst in (inst.waiting, inst.running, inst.swapped, inst.offloaded)
            for r in lst
        ]
        return InstanceReport(
            instance_id=self.instance_id,
            index=inst.instance_id,
            seq=seq,
            sent_unix_s=time.time(),
            role=str(inst.role),
            chunk_size=inst.chunk_size,
            max_batch_reqs=inst.max_batch_reqs,
            block_size=inst.block_size,
            num_blocks=inst.num_blocks,
            num_free_blocks=inst.num_free_blocks,
            kv_bytes_per_token=inst.kv_bytes_per_token,
            step_model=self.step_model_spec,
            data_url=data_url,
            requests=reqs,
            busy_until_unix_s=inst.busy_until_s,
            policy=self.policy.name,
            hints=dict(inst.hints),
            **extra,  # type: ignore[arg-type]
        )


def _req_report(r: ReqState) -> ReqReport:
    return ReqReport(
        req_id=r.req_id,
        req_class=str(r.req_class),
        phase=str(r.phase),
        arrival_unix_s=r.arrival_s,
        num_prompt_tokens=r.num_prompt_tokens,
        max_output_tokens=r.max_output_tokens,
        num_computed_tokens=r.num_computed_tokens,
        num_output_tokens=r.num_output_tokens,
        num_blocks=r.num_blocks,
        ttft_slo_s=r.slo.ttft_s if r.slo else 0.0,
        tpot_slo_s=r.slo.tpot_s if r.slo else 0.0,
        start_unix_s=r.start_s or 0.0,
        first_token_unix_s=r.first_token_s or 0.0,
        last_token_unix_s=r.last_token_s or 0.0,
        max_tbt_s=r.max_tbt_s,
        num_preemptions=r.num_preemptions,
        num_migrations=r.num_migrations,
    )
