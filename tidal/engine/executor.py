"""The one executor: a policy's `StepPlan` carried out on a `ControllableEngine`.

The simulator applies plans to its own records (`tidal.sim.apply`); a live instance applies them
to its engine here, in the order `tidal.policy.base` documents: ``preempt`` (recompute), then
``swap_out``, then ``swap_in``, then one engine step over ``prefill`` and ``decode``. Nothing
here does I/O; the instance service calls `execute` from its engine thread.

CPU attention (OmniServe §3.2): on an engine with `offload`/`recall` (the torch engine with
CPU-attention workers attached), ``offload`` runs after ``swap_out``, ``recall`` after
``swap_in``, and ``cpu_decode`` rides the step. A request a worker will not take, or one that
cannot come back yet, stays where it is and the refusal is logged (`Execution.refused`); an
engine without CPU attention refuses all three the same way, never silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from tidal.engine.api import ControllableEngine, OffloadRefused, StepResult
from tidal.policy.plan import StepPlan

log = logging.getLogger("tidal.executor")


@dataclass
class Execution:
    """What carrying out one plan did."""

    result: StepResult | None  # None when the plan had no tokens to compute
    num_preempted: int = 0  # requests preempted by recompute
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_offloaded: int = 0
    num_recalled: int = 0
    refused: list[str] = field(default_factory=list)  # why parts of the plan were not run


def fit_to_engine(plan: StepPlan, forced: dict[str, int]) -> StepPlan:
    """A plan the engine accepts: a chunk cut by a layer-boundary preemption must resume with
    exactly its own size (`SeqSnapshot.forced_tokens`), whatever size the policy asked for."""
    if not forced or not any(rid in forced for rid in plan.prefill):
        return plan
    prefill = {rid: forced.get(rid, n) for rid, n in plan.prefill.items()}
    return replace(plan, prefill=prefill)


def execute(
    engine: ControllableEngine, plan: StepPlan, forced: dict[str, int] | None = None
) -> Execution:
    """Carry out `plan`. Raises what the engine raises (ValueError for a plan naming unknown
    requests, MemoryError when KV does not fit); the caller logs it and plans again."""
    ex = Execution(result=None)
    cpu_capable = callable(getattr(engine, "offload", None))
    cpu_decode = plan.cpu_decode if cpu_capable else ()
    cpu = [*plan.offload, *plan.recall, *plan.cpu_decode]
    if cpu and not cpu_capable:
        _refuse(
            ex,
            f"CPU attention is not available on this engine: offload/recall/cpu_decode of "
            f"{len(cpu)} request(s) ({', '.join(cpu[:4])}{'...' if len(cpu) > 4 else ''}) "
            "not carried out",
        )
    for rid in plan.preempt:
        engine.preempt(rid)
        ex.num_preempted += 1
    for rid in plan.swap_out:
        engine.swap_out(rid)
        ex.num_swapped_out += 1
    for rid in plan.offload if cpu_capable else ():
        try:
            engine.offload(rid)  # type: ignore[attr-defined]
            ex.num_offloaded += 1
        except OffloadRefused as exc:
            _refuse(ex, f"offload of {rid} refused: {exc}")
    for rid in plan.swap_in:
        engine.swap_in(rid)
        ex.num_swapped_in += 1
    for rid in plan.recall if cpu_capable else ():
        try:
            engine.recall(rid)  # type: ignore[attr-defined]
            ex.num_recalled += 1
        except (MemoryError, ValueError, KeyError) as exc:
            _refuse(ex, f"recall of {rid} not done: {exc}")
    if cpu_decode:  # one just offloaded, or refused, may not be offloaded: ride only those that are
        offloaded = {s.req_id for s in engine.snapshot() if s.status == "offloaded"}
        cpu_decode = tuple(r for r in cpu_decode if r in offloaded)
    # an engine whose requests run by themselves (sglang) steps to collect their tokens even
    # when the plan computes nothing new
    if plan.prefill or plan.decode or cpu_decode or getattr(engine, "self_driven", False):
        step_plan = StepPlan(
            prefill=dict(plan.prefill), decode=tuple(plan.decode), cpu_decode=cpu_decode
        )
        ex.result = engine.step(fit_to_engine(step_plan, forced or {}))
    return ex


def _refuse(ex: Execution, why: str) -> None:
    ex.refused.append(why)
    log.warning("%s", why)
