"""Which instances fell silent and came back: a cut link (the instance's, or the gateway's own
NATS node's) drops the chunks sent meanwhile while this gateway's connection stays up, so no
reconnect shows it. After such a silence a gap in a stream from that instance is final (its
stream runs again), and the streams it ran are checked against its next report."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tidal.schemas.messages import InstanceReport

log = logging.getLogger("tidal.gateway")

# An instance unheard this long (SILENCE_BEATS heartbeats, at least SILENCE_MIN_S) was cut off,
# or we were: a busy instance's beats are late by a step, never by seconds.
SILENCE_BEATS = 4
SILENCE_MIN_S = 2.0
ABANDONED_KEEP_S = 600.0  # how long a re-run request's old id is remembered
RECANCEL_EVERY_S = 1.0
# After a silence ends, messages to the instance may still find no route for a few seconds
# (measured: up to ~6 s while NATS rebuilds its routes' interest).
RELINK_S = 8.0
UNTIL_HEARD_POLL_S = 0.1


class Silences:
    def __init__(self, heartbeat_s: float, on_back: Callable[[float, str], None]) -> None:
        self.silence_s = max(SILENCE_MIN_S, SILENCE_BEATS * heartbeat_s)
        self.on_back = on_back  # (unix time it was heard again, instance)
        self.heard_s: dict[str, float] = {}  # instance -> monotonic time last heard
        self.back_s: dict[str, float] = {}  # instance -> monotonic end of its last silence
        # copies abandoned for a re-run (old req_id -> monotonic time): cancelled again while
        # an instance still reports them (the first cancel may have been lost in the cut)
        self.abandoned: dict[str, float] = {}
        self.recancelled: dict[str, float] = {}  # abandoned req_id -> monotonic last re-cancel

    def heard(self, instance_id: str, now_s: float | None = None) -> None:
        """Note an instance heard from (a beat or a report)."""
        now = time.monotonic() if now_s is None else now_s
        last = self.heard_s.get(instance_id)
        self.heard_s[instance_id] = now
        if last is not None and now - last > self.silence_s:
            self.back_s[instance_id] = now
            log.warning("%s heard again after %.1f s of silence", instance_id, now - last)
            self.on_back(time.time(), instance_id)

    def was_silent_since(self, instance_id: str, since_s: float) -> bool:
        """Whether `instance_id` fell silent (and came back) after monotonic time `since_s`."""
        return self.back_s.get(instance_id, -1.0) > since_s

    def is_silent(self, instance_id: str, now_s: float | None = None) -> bool:
        """Whether `instance_id`, once heard, has been unheard for longer than a silence."""
        now = time.monotonic() if now_s is None else now_s
        last = self.heard_s.get(instance_id)
        return last is not None and now - last > self.silence_s

    def was_cut_around(self, instance_id: str, sent_s: float, now_s: float | None = None) -> bool:
        """Whether a message sent to `instance_id` at monotonic `sent_s` met a cut link: the
        instance is silent now, or came back from a silence shortly before or since (NATS
        rebuilds a returning node's routes and their interest over a few seconds)."""
        return self.is_silent(instance_id, now_s) or self.was_silent_since(
            instance_id, sent_s - RELINK_S
        )

    async def until_heard(self, instance_id: str, timeout_s: float) -> bool:
        """Wait, up to `timeout_s`, for a silent `instance_id` to be heard again; whether it is
        (one never silent is at once)."""
        deadline = time.monotonic() + timeout_s
        while self.is_silent(instance_id):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(UNTIL_HEARD_POLL_S)
        return True

    def still_running(self, rep: InstanceReport, now_s: float | None = None) -> list[str]:
        """The abandoned copies `rep` shows, each at most once per `RECANCEL_EVERY_S` (a cut
        instance's reports arrive in a burst when its link returns)."""
        now = time.monotonic() if now_s is None else now_s
        out = []
        for r in rep.requests:
            if r.req_id in self.abandoned and now - self.recancelled.get(r.req_id, -1e9) > (
                RECANCEL_EVERY_S
            ):
                self.recancelled[r.req_id] = now
                out.append(r.req_id)
        return out

    def abandon(self, req_id: str, now_s: float | None = None) -> None:
        now = time.monotonic() if now_s is None else now_s
        self.abandoned[req_id] = now
        for rid, at in list(self.abandoned.items()):
            if now - at > ABANDONED_KEEP_S:
                del self.abandoned[rid]
                self.recancelled.pop(rid, None)
