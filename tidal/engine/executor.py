"""A policy's `StepPlan` carried out on a `ControllableEngine`, through the one interpreter
(`tidal.plan.interpreter.carry_out`): this module is only the engine's kernel, the work of each
stage on one request. The simulator's kernel is `tidal.sim.apply`. Nothing here does I/O; the
instance service calls `execute` from its engine thread.

What the engine cannot do it declares (`ControllableEngine.capabilities`), and the interpreter
refuses a plan that asks for it (`PlanRefused`, which the instance logs and counts).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from tidal.engine.api import (
    CheckpointingEngine,
    ControllableEngine,
    OffloadRefused,
    StepResult,
)
from tidal.plan import EngineCapabilities, Outcome, PlanRefused, RefusalReason, StepPlan, carry_out
from tidal.schemas.enums import RequestClass

log = logging.getLogger("tidal.executor")

__all__ = ["EngineKernel", "Execution", "execute", "fit_to_engine"]

Execution = Outcome[StepResult]


def fit_to_engine(plan: StepPlan, forced: dict[str, int]) -> StepPlan:
    """A plan the engine accepts: a chunk cut by a layer-boundary preemption must resume with
    exactly its own size (`SeqSnapshot.forced_tokens`), whatever size the policy asked for."""
    if not forced or not any(rid in forced for rid in plan.prefill):
        return plan
    prefill = {rid: forced.get(rid, n) for rid, n in plan.prefill.items()}
    return replace(plan, prefill=prefill)


class EngineKernel:
    """Each stage of a plan on a live engine."""

    def __init__(self, engine: ControllableEngine, forced: dict[str, int] | None = None) -> None:
        self.engine = engine
        self.forced = forced or {}
        self.capabilities: EngineCapabilities = engine.capabilities
        self._snaps = {s.req_id: s for s in engine.snapshot()}

    def is_online(self, req_id: str) -> bool:
        return self._snaps[req_id].req_class is RequestClass.ONLINE

    def priority(self, req_id: str) -> int:
        return self._snaps[req_id].priority

    def top_priority(self) -> int | None:
        here = ("waiting", "running")
        online = RequestClass.ONLINE
        snaps = self._snaps.values()
        return max(
            (s.priority for s in snaps if s.status in here and s.req_class is online),
            default=None,
        )

    def abort_no_kv(self, req_id: str) -> None:
        """The worker ends it with an error event (`Outcome.aborted`)."""
        if not self.engine.abort(req_id):
            raise KeyError(req_id)

    def checkpoint(self, req_id: str) -> None:
        self._checkpointing().checkpoint(req_id)

    def recompute(self, req_id: str) -> None:
        self.engine.recompute(req_id)

    def release(self, req_id: str) -> None:
        self._checkpointing().release(req_id)

    def _checkpointing(self) -> CheckpointingEngine:
        if not isinstance(self.engine, CheckpointingEngine):  # its capabilities said otherwise
            raise PlanRefused(RefusalReason.NO_KV_CHECKPOINT, f"{self.engine.name} cannot")
        return self.engine

    def swap_out(self, req_id: str) -> None:
        self.engine.swap_out(req_id)

    def swap_in(self, req_id: str) -> None:
        self.engine.swap_in(req_id)

    def offload(self, req_id: str) -> None:
        try:
            self.engine.offload(req_id)
        except OffloadRefused as exc:
            raise PlanRefused(
                RefusalReason.CPU_WORKERS_BUSY, f"offload of {req_id}: {exc}"
            ) from exc

    def recall(self, req_id: str) -> None:
        self.engine.recall(req_id)

    def run(self, plan: StepPlan) -> StepResult:
        step = StepPlan(
            prefill=dict(plan.prefill), decode=tuple(plan.decode), cpu_decode=plan.cpu_decode
        )
        return self.engine.step(fit_to_engine(step, self.forced))


def execute(
    engine: ControllableEngine, plan: StepPlan, forced: dict[str, int] | None = None
) -> Execution:
    """Carry out `plan` on `engine`, all or nothing. Raises `PlanRefused` (reason, stage)."""
    return carry_out(EngineKernel(engine, forced), plan)
