"""The scheduler's use of preemption as a bus signal (opt-in: `preempt_for_online` in the cluster
config, or `--preempt-for-online`): an online request that no usable instance has the KV blocks
free for is sent where offline work (and online work of a class below its own) can make the
room, after that instance preempted it
(`tidal.inst.<id>.preempt`, `services/instance/preempt.py`). The rule is the simulator's
(`tidal.policy.preempt.room_for_online`); a refusal or a silent instance leaves the policy's
route as it was.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from services.scheduler.live import LiveCluster
from tidal.config.cluster import ClusterConfig
from tidal.policy.base import RouteAction
from tidal.policy.preempt import room_for_online
from tidal.policy.state import InstanceRole, ReqState
from tidal.schemas import subjects
from tidal.schemas.control import CtlPreempt, CtlPreemptReply

log = logging.getLogger("tidal.scheduler")

PREEMPT_TIMEOUT_S = 2.0  # the instance answers at its next step boundary
_NO_PREFILL = (InstanceRole.STRICT, InstanceRole.DECODE)  # an online prompt cannot start there


async def room_by_preemption(
    nc: NATS, cluster: LiveCluster, req: ReqState, now: float
) -> tuple[int, CtlPreemptReply] | None:
    """(slot, its reply) where offline work was preempted to make room for online `req` now;
    None when the rule does not apply or the instance did not free the blocks."""
    view = cluster.view(now)
    usable = [
        i.instance_id
        for i in view.instances
        if cluster.is_usable(i.instance_id, now) and i.role not in _NO_PREFILL
    ]
    pick = room_for_online(req, view, usable)
    if pick is None:
        return None
    slot, num_blocks = pick
    iid = cluster.instance_id(slot)
    body = msgspec.json.encode(CtlPreempt(num_blocks=num_blocks, below_priority=req.priority))
    try:
        msg = await nc.request(subjects.instance_preempt(iid), body, timeout=PREEMPT_TIMEOUT_S)
        reply = msgspec.json.decode(msg.data, type=CtlPreemptReply)
    except (nats.errors.Error, TimeoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("preempt on %s for %s got no answer: %r", iid, req.req_id, exc)
        return None
    if reply.error:
        log.info("preempt on %s for %s refused: %s", iid, req.req_id, reply.error)
        return None
    log.info(
        "online %s goes to %s: %d KV blocks freed from lower work (%s)",
        req.req_id,
        iid,
        reply.freed_blocks,
        ", ".join(f"{p.req_id} {p.how}" for p in reply.preempted),
    )
    return slot, reply


@dataclass
class OnlineRoom:
    """The scheduler's switch and count."""

    is_on: bool
    num_routes: int = 0  # online requests placed after a preempt signal made their room

    @staticmethod
    def add_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--preempt-for-online",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="an online request no instance has KV room for preempts offline work where "
            "it can make the room, and goes there (default: the config's preempt_for_online)",
        )

    @staticmethod
    def of(args: argparse.Namespace, cfg: ClusterConfig) -> OnlineRoom:
        flag = getattr(args, "preempt_for_online", None)
        return OnlineRoom(cfg.preempt_for_online if flag is None else flag)

    async def route(
        self,
        nc: NATS,
        cluster: LiveCluster,
        req: ReqState,
        now: float,
        action: RouteAction,
        idx: int,
    ) -> tuple[RouteAction, int]:
        """The policy's (action, slot) for online `req`, or where a preemption made room."""
        made = await room_by_preemption(nc, cluster, req, now)
        if made is None:
            return action, idx
        slot = made[0]
        cluster.place(req, slot, now)
        self.num_routes += 1
        return RouteAction.QUEUE, slot
