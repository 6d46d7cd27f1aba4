"""The heartbeat every service publishes; the scheduler learns the cluster from these alone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.aio.client import Client as NATS

from tidal.schemas import codec, subjects
from tidal.schemas.messages import Heartbeat

log = logging.getLogger(__name__)


async def heartbeat_loop(
    nc: NATS, make: Callable[[], Heartbeat], stop: asyncio.Event, interval_s: float
) -> None:
    """Publish `make()` every `interval_s` until `stop` is set (then once more, as it stands)."""
    while True:
        hb = make()
        try:
            await nc.publish(subjects.heartbeat(hb.kind, hb.service_id), codec.encode(hb))
        except Exception as exc:  # a reconnecting client buffers; anything else is logged
            log.warning("heartbeat not sent: %s", exc)
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
