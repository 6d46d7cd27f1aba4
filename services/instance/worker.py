"""An instance worker's live loop: requests in over NATS, the policy's `schedule` before every
engine step, its `StepPlan` carried out on the engine, tokens out to the gateway, and a state
report to the scheduler after each step.

Layer cut (OOCO §3.4.1): an online request that arrives while the step in flight is one the
policy marked `StepPlan.layer_cut` cuts that step at its next layer boundary; the cut chunks
resume later without recompute. Only the instance itself sends this signal, on the arrival it
receives (there is no scheduler -> instance preempt message).

A plan the engine cannot carry out is refused whole (`tidal.plan.PlanRefused`): logged, counted
by reason in `plan_refusals` (reported; the gateway's `tidal_plan_refusals_total`), and planned
again; after MAX_BAD_PLANS refusals in a row the engine's own planner takes one step.
`StepPlan.max_repeat` is a permission, not an order: the policy is asked again before every
step here, which by the contract decides the same as running the plan back to back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS

from services.common.lifecycle import wait_either
from services.common.torch_threads import ComputeThread
from services.instance.chunks import Coalescing, Stream
from services.instance.inbound import Inbound
from services.instance.overlap import (
    Boundary,
    BoundaryLock,
    Ran,
    RepeatChain,
    is_repeatable,
    run_step,
)
from services.instance.policy_adapter import PolicyAdapter
from services.instance.publish import Publisher
from services.instance.report import Reporter
from tidal.engine.api import (
    OUT_OF_KV_ERROR,
    ControllableEngine,
    EngineRequest,
    FinishReason,
    StepResult,
    TokenEvent,
)
from tidal.engine.executor import Execution
from tidal.plan import Outcome, PlanRefused, RefusalReason
from tidal.policy.base import StepPlan
from tidal.policy.state import Slo
from tidal.schemas import codec
from tidal.schemas.messages import (
    ReqReport,
    TokenChunk,
)

log = logging.getLogger("tidal.instance")

IDLE_REPORT_INTERVAL_S = 0.5  # an idle instance still reports, so the view never goes stale
IDLE_PLAN_RETRY_S = 0.02  # the policy left a busy instance idle: ask it again this soon
MAX_BAD_PLANS = 3  # plans the engine refused in a row before one step of its own FCFS planner


class Instance(Inbound, Publisher, Reporter):
    def __init__(
        self,
        nc: NATS,
        instance_id: str,
        engine: ControllableEngine,
        adapter: PolicyAdapter,
        default_slo: Slo,
        compute: ComputeThread | None = None,
        coalescing: Coalescing | None = None,
        overlap: bool = True,
    ) -> None:
        self.nc = nc
        # how long an offline request's tokens may be held back to go out together (`chunks.py`)
        self.coalescing = coalescing or Coalescing()
        # the one thread that runs the engine's torch work (`services.common.torch_threads`)
        self.compute = compute or ComputeThread("engine")
        self.id = instance_id
        self.engine = engine
        self.adapter = adapter
        caps = engine.capabilities
        adapter.inst.num_layers = caps.num_layers if caps.layer_cut else 1  # policies read it
        self.default_slo = default_slo
        self.streams: dict[str, Stream] = {}  # req_id -> where its tokens go
        # req_id -> (its gateway subject, monotonic time) of each request taken lately: a resend
        # of one (the gateway heard no ack across a cut link) is acked, never run again
        self.accepted: dict[str, tuple[str, float]] = {}
        self.pending_add: list[EngineRequest] = []  # handed to the engine between steps
        self.pending_abort: list[str] = []
        self.wake = asyncio.Event()
        # plan and publish while the engine computes (`overlap.py`); False: one after the other
        self.overlap = overlap
        self._self_driven = caps.self_driven
        self.boundary = Boundary()  # set: whatever waits for the next step boundary
        # Held by a step (the loop takes `_lock` itself), an export and an import; the others
        # take it as `engine_lock`, which asks for the next boundary (`overlap.BoundaryLock`).
        self._lock = asyncio.Lock()
        self.engine_lock = BoundaryLock(self._lock, self.boundary)
        # requests whose KV is leaving now (`migration.py`): out of the engine's schedule, still
        # here, so reports list them ("migrating") and nobody takes them for lost
        self.moving_out: dict[str, ReqReport] = {}
        self.draining = False
        self.data_url = ""
        self.started_unix_s = time.time()
        self.num_steps = 0
        self.num_preemptions = 0  # layer-boundary cuts
        self.preempt_latency_s: list[float] = []  # signal -> engine free, recent cuts
        self.last_step_ms = 0.0
        self.in_flight: StepPlan | None = None
        self.plan_refusals: dict[str, int] = {}  # RefusalReason -> plans refused since start
        self.report_seq = 0
        self.finished_ids: list[str] = []  # ended since the last report
        self.unsent: list[TokenEvent] = []  # the last step's events, not yet published
        self.last_report_s = 0.0
        # A request gave its first token since the last report: the scheduler's `place_decode`
        # (push migration) and, for an offline one, the policy's next hand-out to this now
        # idle prefill instance (`online-priority`) wait on a report that shows it decoding,
        # so the next report goes out at once, not up to REPORT_MIN_INTERVAL_S later.
        self.placement_due = False

    def cut_offline_step(self, why: str) -> bool:
        """Cut the step in flight at its next layer boundary if its plan allows it
        (`StepPlan.layer_cut`, OOCO §3.4.1)."""
        plan = self.in_flight
        if plan is None or not plan.layer_cut or not self.engine.request_layer_cut():
            return False
        log.info("cutting the offline step in flight at a layer boundary: %s", why)
        return True

    def refused(self, exc: PlanRefused) -> None:
        """Log and count a refused plan (nothing of it was carried out)."""
        self.plan_refusals[exc.reason] = self.plan_refusals.get(exc.reason, 0) + 1
        log.warning("plan of %s refused: %s", self.adapter.policy.name, exc)

    # ---- the engine loop ----

    def _apply_pending(self) -> tuple[list[TokenEvent], list[tuple[str, TokenChunk]]]:
        """Hand the engine what came in since the last step: the requests it refused as
        events, and what the cancelled ones held back as (subject, chunk) to publish."""
        failed: list[TokenEvent] = []
        held: list[tuple[str, TokenChunk]] = []
        adds, self.pending_add = self.pending_add, []
        for req in adds:
            try:
                self.engine.add(req)
            except ValueError as exc:
                failed.append(TokenEvent(req.req_id, (), "", FinishReason.ERROR, error=str(exc)))
        aborts, self.pending_abort = self.pending_abort, []
        for req_id in aborts:
            self.engine.abort(req_id)
            stream = self.streams.pop(req_id, None)  # a cancelled client wants nothing more
            if stream is not None and (chunk := stream.take()) is not None:
                held.append((stream.reply_subject, chunk))  # but nothing goes out of order
            self.adapter.meta.pop(req_id, None)
        return failed, held

    async def idle_plan(self) -> None:
        """Ask the policy for a plan with no work here (once per idle report): what it plans is
        nothing to run, but it may ask for work in its hints, which the report carries (OOCO's
        strict instances pull offline decodes after a `schedule` that found room)."""
        async with self._lock:
            now = time.time()
            self.adapter.sync(self.engine.snapshot(), self.engine.num_free_blocks(), now)
            plan = self.adapter.plan(now)
        if not plan.is_empty:
            log.debug("an idle instance's plan names work it does not have: %s", plan)

    async def _idle(self, stop: asyncio.Event, timeout_s: float) -> None:
        self.wake.clear()
        await wait_either(self.wake, stop, timeout_s)

    async def run(self, stop: asyncio.Event) -> None:
        num_bad = 0
        # When the work for the next step began: the previous step's end while the loop runs
        # back to back, else the moment it found work. An emulating engine (`step_origin`)
        # counts its step time from here, so this loop's own work (publishing, reporting,
        # planning, the thread hand-off) is inside each emulated step, not added to it.
        origin: float | None = None
        while not stop.is_set():
            origin = time.perf_counter() if origin is None else origin
            if self.pending_abort:  # out before a cancel takes their streams
                await self._send_unsent()
            self.boundary.clear()  # what asked for this boundary is taken in now
            async with self._lock:
                failed, held = self._apply_pending()
            for subject, chunk in held:
                await self.nc.publish(subject, codec.encode(chunk))
            await self._publish(failed)  # and what has been held long enough
            # NOTE: a swapped request is work for the policy (swap_in), not for the engine alone
            if not self.engine.has_work() and not self._has_swapped():
                await self._send_unsent()
                await self.flush_due(everything=True)  # nothing more is coming to join it
                # NOTE: going idle with requests just ended reports them now, not when the idle
                # interval comes round: the scheduler counts them as queued here until it knows.
                stale = time.time() - self.last_report_s > IDLE_REPORT_INTERVAL_S
                if stale:
                    await self.idle_plan()
                await self.report(force=stale or bool(self.finished_ids))
                await self._idle(stop, IDLE_REPORT_INTERVAL_S)
                origin = None
                continue
            # The lock spans snapshot -> plan -> step: a migration exporting a request between
            # them would leave the plan naming a request the engine no longer has.
            async with self._lock:
                now = time.time()
                self.adapter.sync(self.engine.snapshot(), self.engine.num_free_blocks(), now)
                plan = self.adapter.plan(now)
                fcfs = num_bad >= MAX_BAD_PLANS
                # an engine whose requests run by themselves (sglang) steps to collect tokens
                idle = plan.is_empty and not fcfs and not self.engine.capabilities.self_driven
                ok = None
                if not idle:
                    ok = await self._steps(plan, fcfs, origin, stop)
                if self.placement_due:
                    # NOTE: mirrored while the lock is held: a migration taking the lock next
                    # would leave `report` without a sync, and the first token unreported.
                    snaps, free = self.engine.snapshot(), self.engine.num_free_blocks()
                    self.adapter.sync(snaps, free, time.time())
            if ok is None:
                await self._send_unsent()
                await self.report()
                await self._idle(stop, IDLE_PLAN_RETRY_S)  # the policy idles it for now
                origin = None
                continue
            num_bad = 0 if ok else num_bad + 1
            origin = getattr(self.engine, "last_step_end_s", None) if ok else None  # sim only
            if not self.overlap:
                await self._send_unsent()
                await self.report()
        await self._send_unsent()  # stopping: the last step's tokens still go out

    def _has_swapped(self) -> bool:
        return any(s.status == "swapped" for s in self.engine.snapshot())

    async def _steps(
        self,
        plan: StepPlan,
        fcfs: bool,
        origin: float | None,
        stop: asyncio.Event,
    ) -> bool:
        """Run `plan` (and, with overlap, its repeats: `overlap.RepeatChain`), publishing what
        the step before left unsent while each computes; whether it ran. The last step's
        events are left in `unsent`, noted but not yet published. The caller holds the engine
        lock."""
        self.in_flight = plan
        self.adapter.on_step_start(plan, time.time())
        chain = None
        # an engine whose requests run by themselves (sglang) decides its own steps
        if self.overlap and not fcfs and is_repeatable(plan) and not self._self_driven:
            chain = RepeatChain(self.engine, plan, self.boundary, self._reserved_or_stop(stop))
        try:
            if fcfs:
                log.warning("the policy's plans failed %d times; one FCFS step", MAX_BAD_PLANS)
                fut: asyncio.Future[Any] = self.compute.submit(self.engine.step, None)
            elif chain is not None:
                fut = self.compute.submit(chain.first, self.adapter.forced, origin)
            else:
                fut = self.compute.submit(run_step, self.engine, plan, self.adapter.forced, origin)
            queued = self._queue_repeat(chain)
            if self.overlap:  # the step before's outputs go out while this one computes
                await self._send_unsent()
                await self.report()
            ok = self._account(await self._outcome(fut), plan, fcfs)
            while queued is not None:
                running, queued = queued, self._queue_repeat(chain)
                await self._send_unsent()
                await self.report()
                ran = await running
                if ran is not None:  # else it declined at the boundary: the policy plans next
                    ok = self._account(ran, plan, fcfs)
        finally:
            self.in_flight = None
        return ok

    def _queue_repeat(self, chain: RepeatChain | None) -> asyncio.Future[Ran | None] | None:
        if chain is None or not chain.take_one():
            return None
        return self.compute.submit(chain.step)

    def _reserved_or_stop(self, stop: asyncio.Event) -> Callable[[], int]:
        """Blocks held for incoming migrations, for a repeat's room check; a stopping loop
        asks for the boundary (the repeat declines)."""

        def reserved() -> int:
            if stop.is_set():
                self.boundary.ask()
            return self.adapter.num_reserved_blocks

        return reserved

    async def _outcome(self, fut: asyncio.Future[Any]) -> Any:
        """What a step's future gave, or the refusal it raised (logged and counted: None)."""
        try:  # NOTE: the caller holds engine_lock
            return await fut
        except PlanRefused as exc:
            self.refused(exc)
        except (ValueError, MemoryError, KeyError) as exc:
            log.warning("the engine's own planner failed a step: %s", exc)
        return None

    def _account(
        self, out: Ran | Execution | StepResult | None, plan: StepPlan, fcfs: bool
    ) -> bool:
        """A step's outcome counted and its events noted (`Publisher._note`) and left in
        `unsent`: whether it ran."""
        if out is None:
            return False
        if isinstance(out, Ran):  # mirrored as the engine's thread saw it after the step
            self.adapter.sync(out.snapshots, out.num_free_blocks, time.time())
            out = out.execution
        ended: list[TokenEvent] = []
        result: StepResult | None
        if isinstance(out, Outcome):
            result = out.result
            why = OUT_OF_KV_ERROR
            ended = [TokenEvent(r, (), "", FinishReason.ERROR, error=why) for r in out.aborted]
        else:
            result = out
        self._note(ended)
        self.unsent += ended
        if result is None:
            return True
        self.num_steps += 1
        self.last_step_ms = result.telemetry.step_s * 1e3
        ran = result.telemetry.num_requests or result.events or plan.cpu_decode
        if not ran and (plan.prefill or plan.decode) and not fcfs:
            # The engine ran none of the plan (it gave the planned blocks back for lack of
            # room): a plan it can never run would repeat forever, so count it as refused and
            # let the engine's own planner take a step after MAX_BAD_PLANS of them.
            self.refused(PlanRefused(RefusalReason.OUT_OF_KV, "the engine ran none of it", "step"))
            return False
        if getattr(self.engine, "last_step_preempted", False):
            self.num_preemptions += 1
            lat = getattr(self.engine, "last_preempt_latency_s", None)
            if lat is not None:
                self.preempt_latency_s = [*self.preempt_latency_s[-999:], lat]
        elif not fcfs:  # a whole step of the policy's plan: its time against the prediction
            self.adapter.on_step_end(result.telemetry.step_s)
        self._note(result.events)
        self.unsent += result.events
        return True

    async def drain(self, timeout_s: float) -> None:
        """Take no new work; let running requests finish for `timeout_s`, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        stop = asyncio.Event()
        runner = asyncio.create_task(self.run(stop))
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        self.wake.set()
        await runner
        for req_id in list(self.streams):
            self.engine.abort(req_id)
            ev = TokenEvent(req_id, (), "", FinishReason.ABORT, error="instance shutting down")
            await self._publish([ev])
