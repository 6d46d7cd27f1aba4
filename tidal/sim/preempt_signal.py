"""The scheduler's preempt signal in the simulator (`preempt_for_online`, the live scheduler's
`services/scheduler/preempt.py`): an online request that no prefill instance has the KV blocks
free for goes to the instance whose offline work (and online work of a class below its own)
can make the room (`tidal.policy.preempt.room_for_online`, the live rule), which preempts that
work at its next step boundary (live: when the instance takes its engine lock) by release or
recompute, with `below_priority` = the request's priority
(`plan_preemption`, carried out through the one interpreter). Both cost no time: the live
signal's round trip is tens of milliseconds, in the bus latency a route already pays.

NOTE: live, the scheduler routes there only once the instance answered that the blocks are
free; here the victims are chosen at that boundary, and if they are gone by then (ended,
preempted by the policy) nothing is preempted and the request waits as any other.
"""

from __future__ import annotations

from tidal.plan import carry_out
from tidal.policy.base import Route, RouteAction
from tidal.policy.preempt import PreemptRefused, plan_preemption, room_for_online
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, ReqState
from tidal.sim.apply import SimKernel
from tidal.sim.recorder import Recorder
from tidal.sim.resume import Cuts

__all__ = ["PreemptSignals"]

_NO_PREFILL = (InstanceRole.STRICT, InstanceRole.DECODE)


class PreemptSignals:
    """Signals sent and not yet taken in (slot -> KV blocks to free at its next boundary)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[int, int]] = {}  # slot -> (blocks, below_priority)

    def route(self, req: ReqState, route: Route, view: ClusterView) -> Route:
        """The policy's `route` of `req`, or the slot a signal makes room on for it."""
        if not req.is_online or route.action is RouteAction.REJECT:
            return route
        slot = self.room(req, view)
        return route if slot is None else Route.to(slot)

    def room(self, req: ReqState, view: ClusterView) -> int | None:
        """The slot where a signal makes room for online `req` (sent now), or None."""
        usable = [i.instance_id for i in view.instances if i.role not in _NO_PREFILL]
        pick = room_for_online(req, view, usable)
        if pick is None:
            return None
        slot, num_blocks = pick
        blocks, below = self.pending.get(slot, (0, req.priority))
        self.pending[slot] = (blocks + num_blocks, min(below, req.priority))
        return slot

    def take(
        self,
        inst: InstanceState,
        reqs: dict[str, ReqState],
        now: float,
        rec: Recorder,
        cuts: Cuts | None = None,
    ) -> None:
        """At `inst`'s step boundary: preempt what its pending signal asks for."""
        num_blocks, below = self.pending.pop(inst.instance_id, (0, 0))
        if not num_blocks:
            return
        rec.num_preempt_signals += 1
        try:
            pre = plan_preemption(
                inst,
                num_blocks=num_blocks,
                can_release=inst.ckpt_capacity_tokens > 0,
                below_priority=below,
            )
        except PreemptRefused:
            return  # the offline work it counted on is gone: nothing to do
        kernel = SimKernel(inst, reqs, now, rec, cuts)
        kernel.head = len(inst.waiting)  # victims queue behind the online work they made room for
        carry_out(kernel, pre.plan)
        rec.num_preempt_signal_victims += len(pre.victims)
