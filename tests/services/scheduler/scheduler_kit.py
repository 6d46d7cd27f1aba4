"""A scheduler service in this test's event loop, over a real nats-server; and its live half
(`LiveCluster`) alone, on no bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client as NATS

from services.common.bus import connect
from services.scheduler import main as scheduler_main
from services.scheduler.live import LiveCluster
from tidal.config.live import load_live_config
from tidal.policy.registry import make_policy
from tidal.schemas import subjects


@contextlib.asynccontextmanager
async def running_scheduler(nats_url: str, argv: list[str]) -> AsyncIterator[NATS]:
    """`services.scheduler` started with `argv`; yields a client once it answers."""
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler_main.serve(scheduler_main.parse_args(argv), stop))
    nc = await connect(nats_url, "test")
    for _ in range(100):  # wait until the scheduler answers
        try:
            await nc.request(subjects.CTL_STATUS, b"{}", timeout=0.2)
            break
        except Exception:
            await asyncio.sleep(0.05)
    try:
        yield nc
    finally:
        stop.set()
        await task
        await nc.drain()


def make_cluster(policy: str = "aggregated", roles: str = "aggregated,aggregated") -> LiveCluster:
    """A `LiveCluster` for `policy` over the embedded config's slots with these `roles`."""
    live = load_live_config("", policy, roles)
    return LiveCluster(
        policy=make_policy(live.policy, live.context()),
        default_slo=live.cfg.slo,
        max_held=8,
        max_hold_s=60.0,
        slots=live.slots,
    )
