"""The global scheduler: the cluster half of the policy (route, place_decode, tick) over a view
built from the instances' state reports; membership from heartbeats; control.

python -m services.scheduler [--nats-url URL] [--id ID] [--config FILE --policy NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.args import add_bus_args
from services.common.bus import connect, redact, respond, subscribe
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import run_service
from services.scheduler.commands import Commands
from services.scheduler.control import Control, EmptyCtl
from services.scheduler.live import NO_INSTANCE, SLOT_DOWN, LiveCluster, expire_held
from services.scheduler.members import MemberWatch
from services.scheduler.preempt import OnlineRoom
from services.scheduler.reports import Held
from services.scheduler.trace import EventTrace
from tidal import envs
from tidal.cluster.healing import RoleHealer
from tidal.cluster.membership import Membership
from tidal.config.live import load_live_config
from tidal.policy.base import ClusterActions, RouteAction
from tidal.policy.registry import make_policy
from tidal.schemas import subjects
from tidal.schemas.control import CtlDrain, CtlPolicy, CtlRoles
from tidal.schemas.messages import Heartbeat, InstanceReport, RouteReply, RouteRequest

log = logging.getLogger("tidal.scheduler")

OFFLINE_PAUSED_RETRY_S = 30.0
NO_CAPACITY_RETRY_S = 1.0
REJECT_RETRY_S = 1.0
TICK_S = 0.05  # the policy's tick runs at least this often while the cluster has work
# With nothing held, routed or running anywhere, a tick has nothing to decide until a report,
# a held route, a member joining or an instance declared down kicks it; the floor is a backstop.
IDLE_TICK_S = 0.5
# A report kicks the tick this much later, so that a burst of reports makes one tick. Short: a
# push migration waits on it (the report showing a request's first token -> `place_decode`).
TICK_COALESCE_S = 0.001


class Scheduler(MemberWatch):
    def __init__(self, nc: NATS, args: argparse.Namespace, heartbeat_s: float) -> None:
        self.nc = nc
        self.service_id = args.id
        self.heartbeat_s = heartbeat_s
        # NOTE: 4 missed heartbeats before an instance is forgotten: fast enough to route
        # around a dead instance within ~2 s, slow enough to survive a GC pause.
        self.membership = Membership(timeout_s=4 * heartbeat_s)
        self.probe_timeout_s = max(1.0, 2 * heartbeat_s)
        self.probing: set[tuple[str, str]] = set()  # suspects being probed
        self.probe_tasks: set[asyncio.Task[None]] = set()
        self.num_suspects_alive = 0  # suspects that answered (kept, not declared dead)
        self.cut_off_until_s = -1e9  # monotonic time until which no one is forgotten
        self.live = load_live_config(args.config, args.policy, args.roles)
        self.room = OnlineRoom.of(args, self.live.cfg)  # preempt offline work for online
        self.cluster = LiveCluster(
            policy=make_policy(self.live.policy, self.live.context()),
            default_slo=self.live.cfg.slo,
            max_held=args.max_held,
            max_hold_s=args.max_hold_s,
            max_held_tokens=args.max_held_tokens,
            slots=self.live.slots,
            healer=RoleHealer(heal_after_s=args.heal_after_s),
        )
        self.trace = EventTrace()
        self.commands = Commands(nc, self.cluster, self.trace)
        self.offline_paused = False
        self.started_unix_s = time.time()
        self.num_routed = 0
        self.num_rejected = 0
        self.kick = asyncio.Event()
        self.params_override: dict[str, object] = {}
        self.models_seen: set[str] = set()  # served now or before: a gone model is 503, not 404

    # ---- reports ----

    async def on_report(self, rep: InstanceReport, msg: Msg) -> None:
        if self.cluster.on_report(rep):
            if self.trace.is_on:
                phases = [r.phase for r in rep.requests]
                self.trace.write("report", index=rep.index, sent_s=rep.sent_unix_s, phases=phases)
            self.kick.set()

    # ---- routing ----

    async def on_route(self, req: RouteRequest, msg: Msg) -> None:
        """Answer every route request: one the policy cannot take (a value it refuses, say an SLO
        of 0 s) is answered `invalid_request` at once, never left to the gateway's timeout."""
        try:
            await self._route(req, msg)
        except Exception as exc:
            log.warning("route request %s refused: %r", req.req_id, exc)
            reply = RouteReply(error_code="invalid_request", message=f"cannot route: {exc}")
            await respond(msg, reply)

    async def _route(self, req: RouteRequest, msg: Msg) -> None:
        if req.model not in self.models_seen:
            known = ", ".join(self.membership.models()) or "none yet"
            await respond(
                msg,
                RouteReply(
                    error_code="unknown_model",
                    message=f"model {req.model!r} is not served here (serving: {known})",
                ),
            )
            return
        if req.req_class == "offline" and self.offline_paused:
            reply = RouteReply(
                error_code="offline_paused",
                message="offline admission is paused by the operator",
                retry_after_s=OFFLINE_PAUSED_RETRY_S,
            )
            await respond(msg, reply)
            return
        if req.req_class not in ("online", "offline"):
            await respond(msg, RouteReply(error_code="invalid_request", message="bad class"))
            return
        if (held := self.cluster.held.get(req.req_id)) is not None:
            held.msg = msg  # asked again (after a bus outage): answer the newest asker, once
            return
        now = time.time()
        state = self.cluster.new_request(req, now)
        action, idx, reason = self.cluster.route(state, now, req)
        if self.room.is_on and state.is_online and action is not RouteAction.REJECT:
            action, idx = await self.room.route(self.nc, self.cluster, state, now, action, idx)
        if action is RouteAction.QUEUE:
            await self.reply_queue(msg, idx)
        elif action is RouteAction.HOLD:
            if full := self.cluster.room_to_hold(state):
                await self.reply_reject(msg, full, "queue_full")
                return
            self.cluster.held[req.req_id] = Held(state, msg, req, now, reason == SLOT_DOWN)
            self.kick.set()
        elif reason == NO_INSTANCE:
            await self.reply_reject(msg, reason, "no_capacity")
        else:
            await self.reply_reject(msg, reason or "rejected by admission control")

    async def reply_queue(self, msg: Msg, idx: int) -> None:
        iid = self.cluster.instance_id(idx)
        if not iid:
            await self.reply_reject(msg, "no instance is taking work", "no_capacity")
            return
        self.num_routed += 1
        started = self.cluster.reports[idx].started_unix_s
        slo = self.cluster.default_slo
        reply = RouteReply(
            instance_id=iid,
            instance_started_unix_s=started,
            default_ttft_slo_s=slo.ttft_s,
            default_tpot_slo_s=slo.tpot_s,
        )
        await respond(msg, reply)

    async def reply_reject(self, msg: Msg, reason: str, code: str = "rejected") -> None:
        self.num_rejected += 1
        retry = NO_CAPACITY_RETRY_S if code == "no_capacity" else REJECT_RETRY_S
        await respond(msg, RouteReply(error_code=code, message=reason, retry_after_s=retry))

    # ---- the tick loop ----

    async def tick_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.kick.clear()
            try:
                await self.tick_once()
            except Exception:  # a policy bug must not stop the scheduler
                log.exception("tick failed")
            with contextlib.suppress(TimeoutError):
                idle = self.cluster.is_idle()
                await asyncio.wait_for(self.kick.wait(), timeout=IDLE_TICK_S if idle else TICK_S)
            await asyncio.sleep(TICK_COALESCE_S)

    async def tick_once(self) -> None:
        c = self.cluster
        now = time.time()
        await expire_held(c, now, self.reply_reject)
        if not c.reports:
            return
        if heal := c.heal(now):
            lost = ", ".join(c.healer.lost_since) or "none"
            log.warning(
                "roles heal (lost: %s): %s",
                lost,
                ", ".join(f"{c.instance_id(i)} -> {r}" for i, r in heal.items()),
            )
            await self.commands.set_roles(ClusterActions(set_role=heal))
        for rid, waiting in list(c.held.items()):
            if waiting.retry_route:  # its slot was down: ask the policy again
                action, idx, _ = c.route(waiting.req, now, waiting.route)
                if action is RouteAction.QUEUE:
                    del c.held[rid]
                    await self.reply_queue(waiting.msg, idx)
        view = c.view(now)
        for rid, frm, to in c.decode_placements(view, now):
            self.commands.migrate(rid, frm, to, "push")
        actions = c.tick(view, now)
        for rid, idx in actions.dispatch.items():
            h = c.held.pop(rid, None)
            if h is None:
                continue
            c.routed[rid] = (idx, h.req, now)
            self.trace.write("dispatch", req_id=rid, index=idx, tick_unix_s=now)
            await self.reply_queue(h.msg, idx)
        for m in actions.migrate:
            r = c.cache.get(m.req_id)  # the view's ReqState: where it runs, and its class
            if r is not None and r.instance_id is not None:
                kind = "push" if r.is_online else "pull"
                self.commands.migrate(m.req_id, r.instance_id, m.dst, kind)
        if actions.set_role or actions.set_chunk_size:
            await self.commands.set_roles(actions)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    add_bus_args(p)
    p.add_argument("--id", default="scheduler-0", help="service id (letters, digits, _ -)")
    p.add_argument("--config", default="", help="cluster config YAML (default: embedded)")
    p.add_argument("--policy", default="", help="policy name (default: the config's)")
    p.add_argument(
        "--roles", default="", help="comma-separated role per instance slot (default: config's)"
    )
    p.add_argument("--max-held", type=int, default=1024, help="bound of the held queue")
    p.add_argument(
        "--max-hold-s",
        type=float,
        default=envs.max_hold_s(),
        help="longest a request is held (default: TIDAL_MAX_HOLD_S, which the gateway reads too)",
    )
    p.add_argument(
        "--max-held-tokens",
        type=int,
        default=0,
        help="bound of the held queue in prompt + max_tokens tokens (0: none)",
    )
    OnlineRoom.add_args(p)
    p.add_argument(
        "--heal-after-s",
        type=float,
        default=5.0,
        help="when no live instance can prefill (or decode) for this long, the survivors stand "
        "in as aggregated instances until one is back (docs/cluster.md)",
    )
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    subjects.check_token(args.id, "scheduler id")
    nc = await connect(args.nats_url, f"scheduler-{args.id}", args.connect_timeout_s)
    sched = Scheduler(nc, args, envs.heartbeat_s())
    ctl = Control(sched)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(nc.drain)
        await subscribe(nc, subjects.HEARTBEAT_ALL, Heartbeat, sched.on_heartbeat)
        await subscribe(nc, subjects.INSTANCE_STATE_ALL, InstanceReport, sched.on_report)
        q = subjects.SCHEDULER_QUEUE
        await subscribe(nc, subjects.ROUTE, RouteRequest, sched.on_route, queue=q)
        await subscribe(nc, subjects.MODELS, EmptyCtl, ctl.on_models, queue=q)
        await subscribe(nc, subjects.CTL_STATUS, EmptyCtl, ctl.on_status, queue=q, json=True)
        await subscribe(nc, subjects.CTL_OFFLINE_PAUSE, EmptyCtl, ctl.on_pause, json=True)
        await subscribe(nc, subjects.CTL_OFFLINE_RESUME, EmptyCtl, ctl.on_resume, json=True)
        await subscribe(nc, subjects.CTL_POLICY, EmptyCtl, ctl.on_policy_show, json=True)
        await subscribe(nc, subjects.CTL_POLICY_SET, CtlPolicy, ctl.on_policy_set, json=True)
        await subscribe(nc, subjects.CTL_ROLES, CtlRoles, ctl.on_roles, json=True)
        await subscribe(nc, subjects.CTL_DRAIN, CtlDrain, ctl.on_drain, json=True)
        log.info(
            "scheduler %s ready on %s (policy %s, config %s)",
            args.id,
            redact(args.nats_url),
            sched.cluster.policy.name,
            sched.live.path,
        )
        stack.callback(sched.trace.close)
        await asyncio.gather(
            sched.expire_loop(stop),
            sched.tick_loop(stop),
            heartbeat_loop(nc, ctl.heartbeat, stop, sched.heartbeat_s),
        )
    log.info("scheduler %s drained", args.id)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("scheduler", lambda stop: serve(args, stop))
