"""The one executor: a policy's `StepPlan` carried out on a `ControllableEngine`.

The simulator applies plans to its own records (`tidal.sim.apply`); a live instance applies them
to its engine here, in the order `tidal.policy.base` documents: ``preempt`` (recompute), then
``swap_out``, then ``swap_in``, then one engine step over ``prefill`` and ``decode``. Nothing
here does I/O; the instance service calls `execute` from its engine thread.

CPU attention (``offload``, ``recall``, ``cpu_decode``) has no live path yet: a plan naming it
is refused for those requests with a log line (`Execution.refused`), never silently dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from tidal.engine.api import ControllableEngine, StepResult
from tidal.policy.plan import StepPlan

log = logging.getLogger("tidal.executor")


@dataclass
class Execution:
    """What carrying out one plan did."""

    result: StepResult | None  # None when the plan had no tokens to compute
    num_preempted: int = 0  # requests preempted by recompute
    num_swapped_out: int = 0
    num_swapped_in: int = 0
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
    cpu = [*plan.offload, *plan.recall, *plan.cpu_decode]
    if cpu:
        ex.refused.append(
            f"CPU attention is not live yet: offload/recall/cpu_decode of {len(cpu)} request(s) "
            f"({', '.join(cpu[:4])}{'...' if len(cpu) > 4 else ''}) not carried out"
        )
        for why in ex.refused:
            log.warning("%s", why)
    for rid in plan.preempt:
        engine.preempt(rid)
        ex.num_preempted += 1
    for rid in plan.swap_out:
        engine.swap_out(rid)
        ex.num_swapped_out += 1
    for rid in plan.swap_in:
        engine.swap_in(rid)
        ex.num_swapped_in += 1
    # an engine whose requests run by themselves (sglang) steps to collect their tokens even
    # when the plan computes nothing new
    if plan.prefill or plan.decode or getattr(engine, "self_driven", False):
        step_plan = StepPlan(prefill=dict(plan.prefill), decode=tuple(plan.decode))
        ex.result = engine.step(fit_to_engine(step_plan, forced or {}))
    return ex
