"""The scheduler's membership: who is alive, learned from heartbeats. A service that misses its
beats is a suspect, asked directly (SWIM's suspect state) before it is declared dead; a scheduler
that finds everyone silent at once (or no JetStream quorum) is the one cut off, and forgets no one.
An instance declared dead leaves its slot empty in the view and is announced on
`subjects.INSTANCE_DOWN` (the gateways re-place its requests). Mixed into `main.Scheduler`, which
owns the state below."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import jetstream_quorum, redact
from services.scheduler.live import LiveCluster
from tidal.cluster.membership import Member, Membership
from tidal.schemas import codec, subjects
from tidal.schemas.messages import Heartbeat, InstanceDown

log = logging.getLogger("tidal.scheduler")

PROBE_ATTEMPTS = 2
CUT_OFF_GRACE_S = 10.0  # after this scheduler was last found cut off, no one is forgotten


class MemberWatch:
    nc: NATS
    service_id: str
    heartbeat_s: float
    membership: Membership
    probe_timeout_s: float
    probing: set[tuple[str, str]]  # suspects being probed
    probe_tasks: set[asyncio.Task[None]]
    num_suspects_alive: int  # suspects that answered (kept, not declared dead)
    cut_off_until_s: float  # monotonic time until which no one is forgotten
    cluster: LiveCluster
    kick: asyncio.Event  # set: the tick runs now
    models_seen: set[str]  # served now or before: a gone model is 503, not 404

    async def on_heartbeat(self, hb: Heartbeat, msg: Msg) -> None:
        if hb.model:
            self.models_seen.add(hb.model)
        if self.membership.observe(hb, time.monotonic()):
            log.info("%s %s joined (pid %d)", hb.kind, hb.service_id, hb.pid)
            self.kick.set()
        if hb.status == "stopped":
            self.membership.forget(hb.kind, hb.service_id)
            log.info("%s %s left", hb.kind, hb.service_id)
            if hb.kind == "instance":
                self.cluster.forget(hb.service_id)
                await self._announce_down(hb.service_id, "instance stopped")

    async def expire_loop(self, stop: asyncio.Event) -> None:
        reconnects = self.nc.stats.get("reconnects", 0)
        while not stop.is_set():
            if not self.nc.is_connected or self.nc.stats.get("reconnects", 0) != reconnects:
                # NOTE: the scheduler's own link dropped (nats-server restarting, say): nobody's
                # heartbeats came through, so nobody is declared gone for it; after the
                # reconnect every member gets a full timeout to be heard from again.
                reconnects = self.nc.stats.get("reconnects", 0)
                self.membership.extend(time.monotonic())
            if self.membership.is_cut_off(time.monotonic(), "scheduler", self.service_id):
                # everyone else silent at once: it is this scheduler's link, not theirs
                self._cut_off("every other service went silent at once")
            if time.monotonic() < self.cut_off_until_s:
                # NOTE: after a cut the bus knits itself back over seconds (NATS rebuilds its
                # routes one pair at a time): the first services heard again end the "all
                # silent" state, while those behind a route not yet rebuilt would be probed,
                # unanswered, and forgotten. Nobody is judged until the grace has passed.
                self.membership.extend(time.monotonic())
            for member in self.membership.silent(time.monotonic()):
                key = (member.heartbeat.kind, member.heartbeat.service_id)
                if key not in self.probing:
                    self.probing.add(key)
                    task = asyncio.create_task(self._probe(member))
                    self.probe_tasks.add(task)
                    task.add_done_callback(self.probe_tasks.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.heartbeat_s / 2)

    async def _probe(self, member: Member) -> None:
        """A service missed its beats: ask it directly (twice) before declaring it dead. A live
        service whose beats were late (a busy host, a slow link) is kept; only one that does not
        answer is forgotten and its requests re-placed."""
        hb = member.heartbeat
        try:
            for _ in range(PROBE_ATTEMPTS):
                try:
                    await self.nc.request(
                        subjects.ping(hb.kind, hb.service_id), b"", timeout=self.probe_timeout_s
                    )
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    continue
                except Exception as exc:  # our own link: say nothing about the member
                    log.warning("probe of %s %s not sent: %s", hb.kind, hb.service_id, exc)
                    return
                self.membership.vouch(hb.kind, hb.service_id, time.monotonic())
                self.num_suspects_alive += 1
                log.warning(
                    "%s %s missed its heartbeats but answered a probe; kept",
                    hb.kind,
                    hb.service_id,
                )
                return
            if time.monotonic() < self.cut_off_until_s:
                return  # found cut off while this probe ran: its silence says nothing
            if self.membership.is_cut_off(time.monotonic(), "scheduler", self.service_id):
                self._cut_off("every other service went silent while probing")
                return
            if await jetstream_quorum(self.nc, self.probe_timeout_s) is False:
                # NOTE: our NATS node cannot reach JetStream's quorum: we are in the minority
                # side of a partition, and what we cannot hear may be fine
                self._cut_off(f"no JetStream quorum through {redact(self.nc.connected_url)}")
                return
            if self.membership.forget(hb.kind, hb.service_id) is None:
                return  # it left (or came back as a new process) meanwhile
            log.warning(
                "%s %s went silent and did not answer probes; forgetting it",
                *(hb.kind, hb.service_id),
            )
            if member.is_instance:
                self.cluster.forget(hb.service_id)
                await self._announce_down(hb.service_id, "instance stopped heartbeating")
        finally:
            self.probing.discard((hb.kind, hb.service_id))

    def _cut_off(self, why: str) -> None:
        """This scheduler is the one cut off: forget no one, and give every member a full
        timeout from now to be heard from again."""
        now = time.monotonic()
        self.membership.extend(now)
        if now >= self.cut_off_until_s:  # a new cut, not the one under way: say so once
            log.warning("cut off from the cluster (%s); forgetting no one", why)
        self.cut_off_until_s = now + CUT_OFF_GRACE_S

    async def _announce_down(self, instance_id: str, reason: str) -> None:
        self.kick.set()  # roles heal from the tick: an idle one waits for no floor
        event = InstanceDown(instance_id=instance_id, reason=reason)
        await self.nc.publish(subjects.INSTANCE_DOWN, codec.encode(event))
