"""The one interpreter of a `StepPlan`: the simulator, the sim engine and the torch engine (and
SGLang's adapter) carry a plan out through `carry_out`, each behind a `PlanKernel` that does
the work of one stage for one request. The checks, the stage order, eviction by class, the
capability refusals and the undo on failure live here only, so no field can be honoured by one
side and ignored by another (the contract: `tidal.plan.step`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from tidal.plan.capabilities import EngineCapabilities
from tidal.plan.errors import PlanRefused, RefusalReason
from tidal.plan.step import StepPlan

__all__ = ["STAGES", "Outcome", "PlanKernel", "carry_out", "check_plan"]

log = logging.getLogger("tidal.plan")

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

# The stages in the order they run; the compute stage ("step") is last.
STAGES = (
    "abort_no_kv",
    "checkpoint",
    "recompute",
    "release",
    "swap_out",
    "offload",
    "swap_in",
    "recall",
    "step",
)


class PlanKernel(Protocol[R_co]):
    """The work of each stage on one side (simulator records, an engine). Each call either
    does all of its work or raises and changes nothing; `run` is the compute stage."""

    @property
    def capabilities(self) -> EngineCapabilities: ...

    def is_online(self, req_id: str) -> bool:
        """KeyError when the request is unknown here."""
        ...

    def priority(self, req_id: str) -> int:
        """Its request class's priority (higher is served first). KeyError when unknown."""
        ...

    def top_priority(self) -> int | None:
        """The highest priority of the online requests here, waiting or running (None:
        none)."""
        ...

    def abort_no_kv(self, req_id: str) -> None:
        """End the request: it cannot get KV memory (`StepPlan.abort_no_kv`)."""
        ...

    def checkpoint(self, req_id: str) -> None:
        """Copy the request's full KV blocks not yet saved to host memory (`kv_checkpoint`)."""
        ...

    def recompute(self, req_id: str) -> None: ...

    def release(self, req_id: str) -> None:
        """Free a checkpointed request's GPU blocks; it waits swapped (`kv_checkpoint`)."""
        ...

    def swap_out(self, req_id: str) -> None: ...

    def swap_in(self, req_id: str) -> None: ...

    def offload(self, req_id: str) -> None: ...

    def recall(self, req_id: str) -> None: ...

    def run(self, plan: StepPlan) -> R_co:
        """One step over `plan.prefill`, `plan.decode` and `plan.cpu_decode`."""
        ...


@dataclass
class Outcome(Generic[R]):
    """What carrying out one plan did."""

    result: R | None  # the compute stage's result; None when the plan computes nothing
    aborted: list[str] = field(default_factory=list)  # ended for lack of KV memory
    num_recomputed: int = 0  # evicted by recompute (swaps of a `swap_is_recompute` engine too)
    num_checkpointed: int = 0  # requests whose new full blocks were saved to host memory
    num_released: int = 0  # checkpointed requests whose GPU blocks were freed
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_offloaded: int = 0
    num_recalled: int = 0


def check_plan(
    plan: StepPlan,
    caps: EngineCapabilities,
    is_online: Callable[[str], bool],
    priority: Callable[[str], int] | None = None,
    top_priority: Callable[[], int | None] | None = None,
) -> None:
    """Refuse, before anything runs, a plan that no engine state could make valid here.
    `priority` and `top_priority` (the kernel's): an online request may be evicted only for an
    online request of a higher class here (without them, never)."""
    cpu = [*plan.offload, *plan.recall, *plan.cpu_decode]
    if cpu and not caps.cpu_attention:
        raise PlanRefused(
            RefusalReason.NO_CPU_ATTENTION,
            f"offload/recall/cpu_decode of {_names(cpu)}: no CPU-attention workers here",
        )
    if (plan.checkpoint or plan.release) and not caps.kv_checkpoint:
        raise PlanRefused(
            RefusalReason.NO_KV_CHECKPOINT,
            f"checkpoint/release of {_names([*plan.checkpoint, *plan.release])}: "
            "this engine cannot checkpoint KV to host memory",
        )
    if plan.layer_cut and not caps.layer_cut:
        raise PlanRefused(RefusalReason.NO_LAYER_CUT, "this engine cannot cut a step at a layer")
    moves = [
        *plan.abort_no_kv,
        *plan.checkpoint,
        *plan.recompute,
        *plan.release,
        *plan.swap_out,
        *plan.offload,
        *plan.swap_in,
        *plan.recall,
    ]
    computes = [*plan.prefill, *plan.decode, *plan.cpu_decode]
    for group in (moves, computes):
        if len(set(group)) != len(group):
            seen: set[str] = set()
            twice = [r for r in group if r in seen or seen.add(r)]  # type: ignore[func-returns-value]
            raise PlanRefused(RefusalReason.DUPLICATE, f"{_names(twice)} named twice")
    # Eviction by class: offline work may be evicted any time; an online request only by
    # recompute, release or swap_out, and only while an online request of a higher priority
    # is here, waiting or running, or on its way (`evict_below`): the class-over-class rule,
    # `tidal.policy.class_preempt`. It is never offloaded nor checkpointed.
    lower_only = (*plan.recompute, *plan.release, *plan.swap_out)
    offline_only = (
        (plan.offload, "online work is never offloaded by a plan"),
        (plan.checkpoint, "only offline work is checkpointed (and then released)"),
    )
    top: list[int | None] = []  # the priority evicted for, asked once and only when needed
    for rid in lower_only:
        if _online(is_online, rid):
            _check_outranked(rid, plan.evict_below, priority, top_priority, top)
    for rids, why in offline_only:
        for rid in rids:
            if _online(is_online, rid):
                raise PlanRefused(RefusalReason.ONLINE_EVICTION, f"{rid} is online: {why}")
    for rid, n in plan.prefill.items():
        if n < 1:
            raise PlanRefused(RefusalReason.BAD_CHUNK, f"prefill of {n} tokens for {rid}")


def _online(is_online: Callable[[str], bool], rid: str) -> bool:
    try:
        return is_online(rid)
    except KeyError:
        raise PlanRefused(RefusalReason.UNKNOWN_REQUEST, f"{rid} is not here") from None


def _check_outranked(
    rid: str,
    evict_below: int | None,
    priority: Callable[[str], int] | None,
    top_priority: Callable[[], int | None] | None,
    top: list[int | None],
) -> None:
    """Refuse the eviction of online `rid` unless it is of a lower priority than an online
    request here or than the plan's `evict_below`."""
    if priority is None or top_priority is None:
        raise PlanRefused(
            RefusalReason.ONLINE_EVICTION,
            f"{rid} is online: online work is evicted only for a higher class, and this side "
            "knows no priorities",
        )
    if not top:
        known = [p for p in (top_priority(), evict_below) if p is not None]
        top.append(max(known, default=None))
    mine, best = priority(rid), top[0]
    if best is None or mine >= best:
        here = "no online request is here" if best is None else f"the highest is {best}"
        raise PlanRefused(
            RefusalReason.ONLINE_EVICTION,
            f"{rid} is online (priority {mine}): online work is evicted only for a request of "
            f"a higher priority here or on its way (evict_below), and {here}",
        )


def carry_out(kernel: PlanKernel[R], plan: StepPlan) -> Outcome[R]:
    """Carry out `plan` on `kernel`, all of it or nothing (see the module docstring of
    `tidal.plan.step`). Raises `PlanRefused`; by then every stage already run is undone, and a
    request whose undo failed has been recomputed (counted in `num_recomputed`)."""
    caps = kernel.capabilities
    check_plan(plan, caps, kernel.is_online, kernel.priority, kernel.top_priority)
    out: Outcome[R] = Outcome(result=None)
    undo: list[tuple[Callable[[str], None], str]] = []  # (inverse, req_id), in order done
    stage = "abort_no_kv"
    try:
        for rid in plan.abort_no_kv:  # NOTE: no undo: an ended request stays ended
            kernel.abort_no_kv(rid)
            out.aborted.append(rid)
        stage = "checkpoint"
        for rid in plan.checkpoint:  # NOTE: no undo: a copy to host changes nothing on the GPU
            kernel.checkpoint(rid)
            out.num_checkpointed += 1
        stage = "recompute"
        for rid in plan.recompute:
            kernel.recompute(rid)
            out.num_recomputed += 1
        stage = "release"
        for rid in plan.release:  # undone by swap_in: the checkpoint back, its tail recomputed
            kernel.release(rid)
            out.num_released += 1
            undo.append((kernel.swap_in, rid))
        stage = "swap_out"
        for rid in plan.swap_out:
            kernel.swap_out(rid)
            if caps.swap_is_recompute:
                out.num_recomputed += 1
            else:
                out.num_swapped_out += 1
                undo.append((kernel.swap_in, rid))
        stage = "offload"
        for rid in plan.offload:
            kernel.offload(rid)
            out.num_offloaded += 1
            undo.append((kernel.recall, rid))
        stage = "swap_in"
        for rid in plan.swap_in:
            kernel.swap_in(rid)
            out.num_swapped_in += 1
            undo.append((kernel.swap_out, rid))
        stage = "recall"
        for rid in plan.recall:
            kernel.recall(rid)
            out.num_recalled += 1
            undo.append((kernel.offload, rid))
        stage = "step"
        if plan.computes or caps.self_driven:
            out.result = kernel.run(plan)
    except Exception as exc:
        out.num_recomputed += _undo(kernel, undo)
        raise _refusal(exc, stage) from exc
    return out


def _undo(kernel: PlanKernel[R], undo: list[tuple[Callable[[str], None], str]]) -> int:
    """Run the inverses newest first; a request whose inverse fails is recomputed. Returns
    how many were recomputed."""
    num = 0
    for inverse, rid in reversed(undo):
        try:
            inverse(rid)
        except Exception:
            try:
                kernel.recompute(rid)
                num += 1
            except Exception:  # it stays where the failed stage left it (swapped, offloaded)
                log.exception("%s could neither be restored nor recomputed", rid)
    return num


def _refusal(exc: BaseException, stage: str) -> PlanRefused:
    if isinstance(exc, PlanRefused):
        if not exc.stage:
            exc = PlanRefused(exc.reason, exc.detail, stage)
        return exc
    if isinstance(exc, MemoryError):
        return PlanRefused(RefusalReason.OUT_OF_KV, str(exc), stage)
    if isinstance(exc, KeyError):
        return PlanRefused(RefusalReason.UNKNOWN_REQUEST, f"{exc} is not here", stage)
    if isinstance(exc, ValueError):
        return PlanRefused(RefusalReason.WRONG_STATE, str(exc), stage)
    return PlanRefused(RefusalReason.ENGINE_FAILURE, f"{type(exc).__name__}: {exc}", stage)


def _names(rids: Iterable[str]) -> str:
    r = list(rids)
    return ", ".join(r[:4]) + ("..." if len(r) > 4 else "")
