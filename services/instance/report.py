"""An instance's state report to the scheduler (`InstanceReport` on `subjects.instance_state`):
what the policy's mirror holds, the requests handed over but not yet in the engine, those
whose KV is leaving, and the step counters. At most every REPORT_MIN_INTERVAL_S unless
forced: a first token (`placement_due`) or going idle with requests just ended reports at once.
Mixed into `worker.Instance`, which owns the state below."""

from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.client import Client as NATS

from services.instance.overlap import BoundaryLock
from services.instance.policy_adapter import PolicyAdapter
from tidal.cluster.view import SUBMITTED
from tidal.engine.api import ControllableEngine, EngineRequest
from tidal.policy.base import StepPlan
from tidal.schemas import codec, subjects
from tidal.schemas.messages import ReqReport

log = logging.getLogger("tidal.instance")

REPORT_MIN_INTERVAL_S = 0.05  # at most ~20 state reports a second


class Reporter:
    nc: NATS
    id: str
    engine: ControllableEngine
    adapter: PolicyAdapter
    engine_lock: BoundaryLock
    in_flight: StepPlan | None  # the plan of the step computing now
    data_url: str
    draining: bool
    started_unix_s: float
    num_steps: int
    num_preemptions: int  # layer-boundary cuts
    plan_refusals: dict[str, int]  # RefusalReason -> plans refused since start
    last_step_ms: float
    report_seq: int
    last_report_s: float
    finished_ids: list[str]  # ended since the last report
    pending_add: list[EngineRequest]  # handed to the engine between steps
    moving_out: dict[str, ReqReport]  # req_id -> its report while its KV leaves
    placement_due: bool  # a first token since the last report: the next one goes out at once

    def _submitted(self, req: EngineRequest) -> ReqReport:
        """A request handed over but not yet in the engine (it joins at the next step
        boundary): queued here, as the scheduler's view counts it."""
        meta = self.adapter.meta.get(req.req_id)
        arrival = meta.arrival_unix_s if meta is not None else time.time()
        n, max_out = len(req.prompt_token_ids), req.sampling.max_tokens
        cls = str(req.req_class)
        return ReqReport(
            req.req_id, cls, SUBMITTED, arrival, n, max_out, 0, 0, 0, priority=req.priority
        )

    async def report(self, force: bool = False) -> None:
        """Publish the instance's state, at most every REPORT_MIN_INTERVAL_S unless forced or
        a first token is due (`placement_due`), whichever path of the loop sends it: with
        overlap the report of a prefill's step goes out while it computes, and the one after
        it may come from the idle-plan path (a prefill instance leaves its decodes waiting)."""
        now = time.time()
        if not (force or self.placement_due) and now - self.last_report_s < REPORT_MIN_INTERVAL_S:
            return
        if self.in_flight is None and not self.engine_lock.locked():
            self.adapter.sync(self.engine.snapshot(), self.engine.num_free_blocks(), now)
        self.last_report_s = now
        self.placement_due = False
        self.report_seq += 1
        rep = self.adapter.report(
            self.report_seq,
            self.data_url,
            draining=self.draining,
            started_unix_s=self.started_unix_s,
            num_preemptions=self.num_preemptions,
            plan_refusals=dict(self.plan_refusals),
            num_steps=self.num_steps,
            last_step_ms=round(self.last_step_ms, 3),
            emulated=self.engine.is_emulated,
            finished_req_ids=self.finished_ids,
            max_model_len=self.engine.max_model_len,
        )
        extra = [*self.moving_out.values(), *(self._submitted(r) for r in self.pending_add)]
        if extra:
            rep = msgspec.structs.replace(rep, requests=[*rep.requests, *extra])
        self.finished_ids = []
        try:
            await self.nc.publish(subjects.instance_state(self.id), codec.encode(rep))
        except Exception as exc:  # a reconnecting client buffers; anything else is logged
            log.warning("state report not sent: %s", exc)
