"""The global scheduler: learns the cluster from heartbeats, routes requests, answers control.

python -m services.scheduler [--nats-url URL] [--id ID]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import connect, respond, subscribe
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import run_service
from tidal import envs
from tidal.cluster.membership import Member, Membership
from tidal.cluster.routing import RoundRobinRouter
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    CtlOfflineAdmission,
    Heartbeat,
    InstanceDown,
    RouteReply,
    RouteRequest,
)

log = logging.getLogger("tidal.scheduler")

OFFLINE_PAUSED_RETRY_S = 30.0
NO_CAPACITY_RETRY_S = 1.0


class EmptyCtl(msgspec.Struct):
    """Control requests that take no arguments accept `{}` (or an empty payload)."""


class Scheduler:
    def __init__(self, nc: NATS, service_id: str, heartbeat_s: float) -> None:
        self.nc = nc
        self.service_id = service_id
        self.heartbeat_s = heartbeat_s
        # NOTE: 4 missed heartbeats before an instance is forgotten: fast enough to route
        # around a dead instance within ~2 s, slow enough to survive a GC pause.
        self.membership = Membership(timeout_s=4 * heartbeat_s)
        self.router = RoundRobinRouter()
        self.offline_paused = False
        self.started_unix_s = time.time()
        self.num_routed = 0

    # ---- heartbeats and membership ----

    async def on_heartbeat(self, hb: Heartbeat, msg: Msg) -> None:
        if self.membership.observe(hb, time.monotonic()):
            log.info("%s %s joined (pid %d)", hb.kind, hb.service_id, hb.pid)
        if hb.status == "stopped":
            self.membership.forget(hb.kind, hb.service_id)
            log.info("%s %s left", hb.kind, hb.service_id)
            if hb.kind == "instance":
                await self._announce_down(hb.service_id, "instance stopped")

    async def expire_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for member in self.membership.expire(time.monotonic()):
                hb = member.heartbeat
                log.warning("%s %s went silent; forgetting it", hb.kind, hb.service_id)
                if member.is_instance:
                    await self._announce_down(hb.service_id, "instance stopped heartbeating")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.heartbeat_s / 2)

    async def _announce_down(self, instance_id: str, reason: str) -> None:
        event = InstanceDown(instance_id=instance_id, reason=reason)
        await self.nc.publish(subjects.INSTANCE_DOWN, codec.encode(event))

    # ---- routing ----

    async def on_route(self, req: RouteRequest, msg: Msg) -> None:
        if req.req_class == "offline" and self.offline_paused:
            reply = RouteReply(
                error_code="offline_paused",
                message="offline admission is paused by the operator",
                retry_after_s=OFFLINE_PAUSED_RETRY_S,
            )
        else:
            decision = self.router.route(req.model, self.membership.instances(), req.exclude)
            reply = RouteReply(
                instance_id=decision.instance_id,
                error_code=decision.error_code,
                message=decision.message,
                retry_after_s=NO_CAPACITY_RETRY_S if decision.error_code == "no_capacity" else 0,
            )
            self.num_routed += not decision.error_code
        await respond(msg, reply)

    async def on_models(self, _: EmptyCtl, msg: Msg) -> None:
        await respond(msg, self.membership.models())

    # ---- control ----

    async def on_status(self, _: EmptyCtl, msg: Msg) -> None:
        await respond(msg, self.status(), json=True)

    async def on_pause(self, _: EmptyCtl, msg: Msg) -> None:
        self.offline_paused = True
        log.info("offline admission paused by operator")
        await respond(msg, CtlOfflineAdmission(offline_paused=True), json=True)

    async def on_resume(self, _: EmptyCtl, msg: Msg) -> None:
        self.offline_paused = False
        log.info("offline admission resumed by operator")
        await respond(msg, CtlOfflineAdmission(offline_paused=False), json=True)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        services = [self._describe(m, now) for m in self.membership.members.values()]
        services.sort(key=lambda s: (subjects.SERVICE_KINDS.index(s["kind"]), s["id"]))
        return {
            "scheduler": self.service_id,
            "offline_paused": self.offline_paused,
            "num_routed": self.num_routed,
            "models": self.membership.models(),
            "services": services,
        }

    @staticmethod
    def _describe(m: Member, now: float) -> dict[str, Any]:
        hb = m.heartbeat
        out: dict[str, Any] = {
            "kind": hb.kind,
            "id": hb.service_id,
            "pid": hb.pid,
            "status": hb.status,
            "uptime_s": round(now - m.first_seen_s, 1),
            "last_seen_s_ago": round(now - m.last_seen_s, 2),
        }
        if hb.kind == "instance":
            out |= {"role": hb.role, "engine": hb.engine, "model": hb.model}
            out["emulated"] = hb.is_emulated
            if hb.load is not None:
                out["load"] = msgspec.structs.asdict(hb.load)
        if hb.info:
            out["info"] = dict(hb.info)
        return out

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            service_id=self.service_id,
            kind="scheduler",
            pid=os.getpid(),
            started_unix_s=self.started_unix_s,
            sent_unix_s=time.time(),
            info={"offline_paused": str(self.offline_paused).lower()},
        )


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    subjects.check_token(args.id, "scheduler id")
    nc = await connect(args.nats_url, f"scheduler-{args.id}", args.connect_timeout_s)
    sched = Scheduler(nc, args.id, envs.heartbeat_s())
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(nc.drain)
        await subscribe(nc, subjects.HEARTBEAT_ALL, Heartbeat, sched.on_heartbeat)
        q = subjects.SCHEDULER_QUEUE
        await subscribe(nc, subjects.ROUTE, RouteRequest, sched.on_route, queue=q)
        await subscribe(nc, subjects.MODELS, EmptyCtl, sched.on_models, queue=q)
        await subscribe(nc, subjects.CTL_STATUS, EmptyCtl, sched.on_status, queue=q, json=True)
        await subscribe(nc, subjects.CTL_OFFLINE_PAUSE, EmptyCtl, sched.on_pause, json=True)
        await subscribe(nc, subjects.CTL_OFFLINE_RESUME, EmptyCtl, sched.on_resume, json=True)
        log.info("scheduler %s ready on %s", args.id, args.nats_url)
        await asyncio.gather(
            sched.expire_loop(stop),
            heartbeat_loop(nc, sched.heartbeat, stop, sched.heartbeat_s),
        )
    log.info("scheduler %s drained", args.id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    p.add_argument("--nats-url", default=envs.NATS_URL.get(), help="NATS server to join")
    p.add_argument("--id", default="scheduler-0", help="service id (letters, digits, _ -)")
    p.add_argument("--connect-timeout-s", type=float, default=10.0, help="give up after this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("scheduler", lambda stop: serve(args, stop))
