"""Which CPU-attention workers an instance uses: every worker heartbeating on the bus with a
data-plane address (OmniServe §4: a worker on another host is just another address). A worker
that says it stopped, or stops heartbeating for `STALE_AFTER_BEATS` beats, is dropped (its
requests recompute); one that comes back at a new address is connected again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import subscribe
from services.instance.cpu_attn_link import CpuAttnPool
from tidal import envs
from tidal.schemas import subjects
from tidal.schemas.messages import Heartbeat

log = logging.getLogger("tidal.instance")
STALE_AFTER_BEATS = 5


class Discovery:
    def __init__(self, pool: CpuAttnPool) -> None:
        self.pool = pool
        self.last_seen: dict[str, float] = {}
        self._connecting: set[str] = set()

    async def start(self, nc: NATS) -> None:
        await subscribe(nc, f"{subjects.PREFIX}.hb.cpu_attn.*", Heartbeat, self.on_heartbeat)

    async def on_heartbeat(self, hb: Heartbeat, msg: Msg) -> None:
        wid = hb.service_id
        if hb.kind != "cpu_attn":
            return
        if hb.status == "stopped":
            self.last_seen.pop(wid, None)
            await asyncio.to_thread(self.pool.remove, wid)
            return
        addr = hb.info.get("data_addr", "")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            log.warning("CPU-attention worker %s heartbeats without a data address", wid)
            return
        self.last_seen[wid] = time.monotonic()
        conn = self.pool.workers.get(wid)
        if conn is not None and conn.alive and conn.addr == addr:
            return
        if wid in self._connecting:
            return
        self._connecting.add(wid)
        try:
            await asyncio.to_thread(self.pool.connect, wid, host, int(port))
        except OSError as exc:
            log.warning("cannot reach CPU-attention worker %s at %s: %s", wid, addr, exc)
        finally:
            self._connecting.discard(wid)

    async def reap(self, stop: asyncio.Event) -> None:
        """Drop workers whose heartbeats stopped (a hung worker holds its requests forever)."""
        period = envs.heartbeat_s()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=period)
            cutoff = time.monotonic() - STALE_AFTER_BEATS * period
            for wid in [w for w, t in self.last_seen.items() if t < cutoff]:
                log.warning("CPU-attention worker %s stopped heartbeating; dropping it", wid)
                del self.last_seen[wid]
                await asyncio.to_thread(self.pool.remove, wid)
