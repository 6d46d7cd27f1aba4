"""Preemption as a bus signal: `tidal.inst.<id>.preempt` (JSON `CtlPreempt`, answered with a
`CtlPreemptReply`), sent by the scheduler to make room for an online request here, or by a
person with the NATS CLI.

At the next step boundary (it takes the engine lock, which asks for the boundary and so ends a
chain of repeated decode steps there) the instance mirrors its engine, picks the offline
victims (`tidal.policy.preempt.plan_preemption`) and carries out a `StepPlan` with only their
eviction stages through the one interpreter (`tidal.engine.executor.execute`): `release` for a
checkpointed request on an engine that keeps checkpoints, else `swap_out` (when asked) or
`recompute`. The preempted requests resume as the policy plans them (swap_in, or prefill again).
Online work is preempted only with `below_priority`, and only of a class below it (recomputed;
the scheduler sends the arriving request's priority); a malformed or impossible request changes
nothing and is answered with `error`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from tidal.engine.executor import execute
from tidal.plan import PlanRefused
from tidal.policy.preempt import Preemption, PreemptRefused, plan_preemption
from tidal.schemas.control import CtlPreempt, CtlPreemptReply, Preempted
from tidal.schemas.enums import RequestClass

if TYPE_CHECKING:
    from services.instance.worker import Instance

log = logging.getLogger("tidal.instance")

MAX_PRIORITY = 2**31 - 1  # a request class's priority fits a signed 32-bit integer


def parse(data: bytes) -> CtlPreempt:
    """A `CtlPreempt` from JSON; ValueError names what is wrong."""
    try:
        req = msgspec.json.decode(data or b"{}", type=CtlPreempt)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"bad preempt request: {exc}") from None
    if req.req_class != RequestClass.OFFLINE.value:
        raise ValueError(f"req_class {req.req_class!r}: only offline work is ever preempted")
    if req.num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {req.num_blocks}")
    if req.below_priority is not None and abs(req.below_priority) > MAX_PRIORITY:
        raise ValueError(
            f"below_priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
            f"got {req.below_priority}"
        )
    return req


class Preemptor:
    """Answers one instance's preempt subject."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.num_preempted = 0  # requests preempted by the signal since start
        self.last_free_s: float | None = None  # the last signal: received -> blocks free, s

    async def on_preempt(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        try:
            reply = await self.preempt(parse(msg.data))
        except (ValueError, KeyError) as exc:  # PreemptRefused too
            free = self.inst.engine.num_free_blocks()
            reply = CtlPreemptReply(error=str(exc), num_free_blocks=free)
        if not reply.error:
            self.last_free_s = time.perf_counter() - t0
            reply = msgspec.structs.replace(reply, free_ms=round(self.last_free_s * 1e3, 3))
            log.info(
                "preempted %s by signal: %d KV blocks free in %.1f ms (%.1f ms to the boundary)",
                ", ".join(f"{p.req_id} ({p.how})" for p in reply.preempted),
                reply.freed_blocks,
                self.last_free_s * 1e3,
                reply.boundary_ms,
            )
            self.inst.wake.set()
            await self.inst.report(force=True)
        if msg.reply:
            await msg.respond(msgspec.json.encode(reply))

    async def preempt(self, req: CtlPreempt) -> CtlPreemptReply:
        """Preempt at the next step boundary; raises ValueError (nothing changed)."""
        inst = self.inst
        engine = inst.engine
        caps = engine.capabilities
        if caps.self_driven:
            raise PreemptRefused(f"the {engine.name} engine schedules itself: no preemption")
        t0 = time.perf_counter()
        async with inst.engine_lock:
            boundary_s = time.perf_counter() - t0
            adapter = inst.adapter
            before = engine.num_free_blocks()
            adapter.sync(engine.snapshot(), before, time.time())
            pre = plan_preemption(
                adapter.inst,
                req_ids=req.req_ids,
                num_blocks=req.num_blocks,
                can_release=caps.kv_checkpoint,
                can_swap=not caps.swap_is_recompute,
                swap=req.swap,
                below_priority=req.below_priority,
            )
            try:
                await inst.compute.run(execute, engine, pre.plan)
            except PlanRefused as exc:
                raise PreemptRefused(f"the engine refused the preemption: {exc}") from None
            after = engine.num_free_blocks()
            adapter.sync(engine.snapshot(), after, time.time())
        self._count(pre)
        preempted = [Preempted(v.req_id, v.how, v.tokens_lost) for v in pre.victims]
        return CtlPreemptReply(
            after - before, preempted, after, boundary_ms=round(boundary_s * 1e3, 3)
        )

    def _count(self, pre: Preemption) -> None:
        self.num_preempted += len(pre.victims)
        for v in pre.victims:
            m = self.inst.adapter.meta.get(v.req_id)
            if m is not None:
                m.num_preemptions += 1
