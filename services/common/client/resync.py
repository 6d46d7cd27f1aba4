"""Streams cut by a bus outage: find them after the reconnect and have them run again.

Token chunks are plain NATS messages: while nats-server is down (or restarting) they are lost.
A request that ended during the outage then never delivers its last chunk, and whoever reads
its stream (an HTTP client, a batch line) would wait forever. After each reconnect, every open
stream is checked against its instance's first state report made after the outage: a request
the instance no longer has is lost, and is run again from its prompt plus the tokens already
received (the same recompute as for a dead instance, without avoiding that instance).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from nats.aio.client import Client as NATS

from tidal.schemas.messages import InstanceReport

log = logging.getLogger("tidal.gateway")

POLL_S = 0.5  # how often the connection's reconnect count is looked at
CHECK_WINDOW_S = 15.0  # how long after a reconnect the instances' reports are awaited
REPORT_AFTER_S = 0.2  # a report sent this long after the reconnect shows the state after it
STALL_S = 10.0  # a stream this long without a chunk is checked against its instance's reports


class Stream(Protocol):
    instance_id: str
    is_finished: bool
    progress_unix_s: float  # when it was last placed or last delivered a chunk


class StreamResync:
    def __init__(
        self,
        nc: NATS,
        streams: Mapping[str, Stream],
        lost: Callable[[Any, str], None],
    ) -> None:
        self.nc = nc
        self.streams = streams  # req_id -> open stream
        self.lost = lost  # (stream, reason): run it again
        self.reports: dict[str, tuple[float, frozenset[str]]] = {}  # instance -> (sent, req_ids)
        self._task: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[int]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    def on_report(self, rep: InstanceReport) -> None:
        self.reports[rep.instance_id] = (rep.sent_unix_s, frozenset(r.req_id for r in rep.requests))

    async def _watch(self) -> None:
        seen = self.nc.stats.get("reconnects", 0)
        while True:
            await asyncio.sleep(POLL_S)
            self.sweep(time.time())
            n = self.nc.stats.get("reconnects", 0)
            if n != seen:
                seen = n
                self.check_soon(time.time())

    def check_soon(self, since_unix_s: float, instance_id: str = "") -> None:
        """`check` in a task of its own."""
        task = asyncio.create_task(self.check(since_unix_s, instance_id))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def check(self, since_unix_s: float, instance_id: str = "") -> int:
        """Hand every open stream (of `instance_id`, else of any instance) whose instance's
        post-outage report lacks it to `lost`; how many were."""
        pending = {
            rid
            for rid, s in self.streams.items()
            if not s.is_finished and (not instance_id or s.instance_id == instance_id)
        }
        n = 0
        deadline = time.monotonic() + CHECK_WINDOW_S
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            for rid in list(pending):
                s = self.streams.get(rid)
                if s is None or s.is_finished:
                    pending.discard(rid)
                    continue
                sent, ids = self.reports.get(s.instance_id, (0.0, frozenset()))
                if sent < since_unix_s + REPORT_AFTER_S:
                    continue  # no report from after the outage yet
                pending.discard(rid)
                if rid not in ids:
                    n += 1
                    log.warning("request %s: its stream was cut by a bus outage; recomputing", rid)
                    self.lost(s, "its stream was cut by a bus outage")
        return n

    def sweep(self, now_unix_s: float) -> int:
        """Hand to `lost` every stream silent for `STALL_S` that its instance's reports, made
        `STALL_S` after its last progress, no longer show (say, lost with its instance in the
        middle of a migration); how many were."""
        n = 0
        for rid, s in list(self.streams.items()):
            if s.is_finished or now_unix_s - s.progress_unix_s < STALL_S:
                continue
            if not s.progress_unix_s:
                # not placed yet: `place` owns it (the instance may still be tokenising a long
                # prompt before it acks), with timeouts of its own
                continue
            sent, ids = self.reports.get(s.instance_id, (0.0, frozenset()))
            if sent > s.progress_unix_s + STALL_S and rid not in ids:
                s.progress_unix_s = now_unix_s  # once per stall
                n += 1
                log.warning("request %s: %s no longer has it; recomputing", rid, s.instance_id)
                self.lost(s, f"{s.instance_id} no longer has it")
        return n

    async def stop(self) -> None:
        for t in [self._task, *self._checks]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
