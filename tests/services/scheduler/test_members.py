"""The scheduler's membership (`services.scheduler.members`): a silent instance is probed, then
forgotten and announced, or kept when it answers."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS

from tests.services.scheduler.test_scheduler import join, route, status
from tidal.schemas import codec, subjects
from tidal.schemas.messages import InstanceDown

pytestmark = pytest.mark.nats


async def test_silent_instance_is_forgotten_and_announced(cluster: NATS) -> None:
    downs: list[InstanceDown] = []

    async def on_down(msg) -> None:  # type: ignore[no-untyped-def]
        downs.append(codec.decode(msg.data, InstanceDown))

    await cluster.subscribe(subjects.INSTANCE_DOWN, cb=on_down)
    await join(cluster, "inst-a", 0, "aggregated")
    assert (await route(cluster)).instance_id == "inst-a"
    await asyncio.sleep(0.8)  # > 4 heartbeats of 0.1 s with no beat from inst-a
    assert [d.instance_id for d in downs] == ["inst-a"]
    assert (await route(cluster)).error_code == "no_capacity"


async def test_a_silent_instance_that_answers_its_probe_is_kept(cluster: NATS) -> None:
    """Missed heartbeats make an instance a suspect, not a corpse: the scheduler asks it
    directly (SWIM's suspect state) and keeps it when it answers."""
    downs: list[InstanceDown] = []

    async def on_down(msg) -> None:  # type: ignore[no-untyped-def]
        downs.append(codec.decode(msg.data, InstanceDown))

    async def pong(msg) -> None:  # type: ignore[no-untyped-def]
        await msg.respond(b"pong")

    await cluster.subscribe(subjects.INSTANCE_DOWN, cb=on_down)
    await cluster.subscribe(subjects.ping("instance", "inst-a"), cb=pong)
    await join(cluster, "inst-a", 0, "aggregated")
    await asyncio.sleep(1.2)  # 12 heartbeat periods without a beat, but it answers probes
    assert downs == []
    assert (await route(cluster)).instance_id == "inst-a"
    st = await status(cluster)
    sched = next(s for s in st["services"] if s["kind"] == "scheduler")
    assert int(sched["info"]["suspects_alive"]) >= 1
