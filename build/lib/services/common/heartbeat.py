"""The heartbeat every service publishes; the scheduler learns the cluster from these alone.

Beside it, every service measures its own event loop's lag (`looplag.py`, carried in the beat)
and answers liveness probes on `subjects.ping(kind, id)`: a scheduler that misses a service's
beats asks it directly before declaring it dead (`services/scheduler/main.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.looplag import LoopLag
from tidal.schemas import codec, subjects
from tidal.schemas.messages import Heartbeat

log = logging.getLogger(__name__)


async def heartbeat_loop(
    nc: NATS,
    make: Callable[[], Heartbeat],
    stop: asyncio.Event,
    interval_s: float,
    lag: LoopLag | None = None,
) -> None:
    """Publish `make()` every `interval_s` until `stop` is set (then once more, as it stands),
    with the loop's lag in `info`, answering pings meanwhile."""
    lag = lag or LoopLag()
    probe = asyncio.create_task(lag.run(stop))
    first = make()

    async def pong(msg: Msg) -> None:
        with contextlib.suppress(Exception):
            await msg.respond(b"pong")

    sub = None
    try:
        sub = await nc.subscribe(subjects.ping(first.kind, first.service_id), cb=pong)
    except Exception as exc:
        log.warning("liveness probes not answered: %s", exc)
    try:
        while True:
            hb = make()
            hb = msgspec.structs.replace(hb, info={**hb.info, **lag.info()})
            try:
                await nc.publish(subjects.heartbeat(hb.kind, hb.service_id), codec.encode(hb))
            except Exception as exc:  # a reconnecting client buffers; anything else is logged
                log.warning("heartbeat not sent: %s", exc)
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
    finally:
        probe.cancel()
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
