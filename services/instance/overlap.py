"""Overlap: the instance's own work between two engine steps done while a step computes.

Two things used to sit between the end of one step and the start of the next, with the engine
idle: publishing the step's tokens and the state report, and, for every step, the hand-off from
the engine's thread to the loop, the policy's sync and plan, and back (SGLang's overlap
scheduler and vLLM's async scheduling remove the same gap on a GPU). With overlap on
(`tidal up --no-overlap` turns it off):

* **Outputs after the next dispatch.** A step's events are *noted* as soon as it returns (each
  request's token times, `Publisher._note`: everything the policy reads), the next step is
  planned and handed to the engine's thread, and only then are the events published and the
  report sent, while that step computes.
* **Repeated decode steps queued behind.** A decode-only plan with `StepPlan.max_repeat > 1`
  allows the same batch to run again without asking the policy (the plan contract: asking again
  decides the same). So the next step is queued on the engine's thread behind the one in flight
  (`RepeatChain`) and starts the moment it ends, with no hand-off at all. At that boundary, on
  the engine's thread, it runs only if nothing the policy would see differently happened: the
  step before ran whole (no layer cut), every request of the batch got its token and none
  ended, every request still has room for a block, and nothing asked for the boundary
  (`Boundary`: an arrival, a cancel, a migration or import waiting for the engine lock, a stop).
  Otherwise it declines, and the loop asks the policy as usual.

What each thread may touch (the safety argument): the engine is read and written only between
steps by whoever holds the engine lock, and during a step only by the engine's thread. While a
step computes, the loop reads the policy's mirror (`PolicyAdapter.inst`, synced from the engine
before the step was dispatched), the streams it publishes, the engine's tokenizer (as request
intake always did) and `request_layer_cut`, which is thread-safe; it never syncs from the engine
(`Instance.report` skips the sync while a plan is in flight). A queued repeat reads the engine
on the engine's own thread, after the step before it returned. Preemption (a layer cut) and
migrations still take effect at the next step boundary: the cut asks the step in flight, and a
migration's request for the lock stops the chain there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType

from tidal.engine.api import ControllableEngine, SeqSnapshot
from tidal.engine.executor import Execution, execute
from tidal.policy.base import StepPlan


class Boundary:
    """Set by anything that must act between two steps; a queued repeat then declines."""

    def __init__(self) -> None:
        self._event = threading.Event()  # read on the engine's thread

    def ask(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    @property
    def asked(self) -> bool:
        return self._event.is_set()


class BoundaryLock:
    """The engine lock as everyone but the instance loop takes it (migrations, imports): asking
    for it asks for the next step boundary, so a chain of repeated steps ends there instead of
    making the migration wait out the whole chain."""

    def __init__(self, lock: asyncio.Lock, boundary: Boundary) -> None:
        self._lock = lock
        self._boundary = boundary

    async def __aenter__(self) -> None:
        self._boundary.ask()
        await self._lock.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


def is_repeatable(plan: StepPlan) -> bool:
    """A plan whose next step may run without asking the policy: decodes on the GPU only, and
    the policy's permission to repeat it (`StepPlan.max_repeat`)."""
    return (
        plan.max_repeat > 1
        and bool(plan.decode)
        and not (plan.prefill or plan.cpu_decode or plan.evicts or plan.swap_in)
        and not (plan.recall or plan.abort_no_kv)
    )


class Ran:
    """A step run by a `RepeatChain`, and the engine as it left it (read on the engine's thread,
    so the loop can mirror it for the policy and the reports without touching the engine)."""

    __slots__ = ("execution", "num_free_blocks", "snapshots")

    def __init__(self, execution: Execution, engine: ControllableEngine) -> None:
        self.execution = execution
        self.snapshots: list[SeqSnapshot] = engine.snapshot()
        self.num_free_blocks = engine.num_free_blocks()


class RepeatChain:
    """A decode-only plan's first step and up to `plan.max_repeat - 1` repeats, each queued on
    the engine's thread behind the step before it (`first`, then `step`, both run there)."""

    def __init__(
        self,
        engine: ControllableEngine,
        plan: StepPlan,
        boundary: Boundary,
        num_reserved_blocks: Callable[[], int],
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.boundary = boundary
        self.num_reserved_blocks = num_reserved_blocks
        self.left = plan.max_repeat - 1  # repeats not yet queued
        self.last: Execution | None = None  # the latest step's outcome (engine's thread)
        self.stopped = False  # a repeat declined: those queued behind it decline too
        self.num_run = 0

    def take_one(self) -> bool:
        """Count a repeat to queue; False when the plan's permission is used up."""
        if self.left <= 0 or self.stopped:
            return False
        self.left -= 1
        return True

    def first(self, forced: dict[str, int], origin: float | None) -> Ran:
        """The plan's first step (engine's thread)."""
        self.last = None
        self.last = run_step(self.engine, self.plan, forced, origin)
        return Ran(self.last, self.engine)

    def step(self) -> Ran | None:
        """The next repeat, if the boundary allows it (engine's thread); None: declined."""
        if self.stopped or not self._may_run():
            self.stopped = True
            return None
        origin = getattr(self.engine, "last_step_end_s", None)  # an emulating engine's clock
        self.last = None
        self.last = run_step(self.engine, self.plan, {}, origin)
        self.num_run += 1
        return Ran(self.last, self.engine)

    def _may_run(self) -> bool:
        last = self.last
        if self.boundary.asked or last is None or last.aborted or last.result is None:
            return False
        if getattr(self.engine, "last_step_preempted", False):
            return False  # cut at a layer boundary: its decodes retry, as the policy decides
        events = last.result.events
        if any(ev.finish_reason is not None for ev in events):
            return False
        if {ev.req_id for ev in events if ev.token_ids} != set(self.plan.decode):
            return False
        free = self.engine.num_free_blocks() - self.num_reserved_blocks()
        return free >= len(self.plan.decode)  # each request may need one new block


def run_step(
    engine: ControllableEngine, plan: StepPlan, forced: dict[str, int], origin: float | None
) -> Execution:
    """`execute` with an emulating engine's step clock started at `origin` (`SimEngine`)."""
    emulates = hasattr(engine, "step_origin")
    if emulates:
        engine.step_origin = origin  # type: ignore[attr-defined]
    try:
        return execute(engine, plan, forced)
    finally:
        if emulates:
            engine.step_origin = None  # type: ignore[attr-defined]
