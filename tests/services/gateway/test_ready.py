"""`/health` is liveness (the process answers), `/ready` readiness: bus connected, a scheduler and
an instance taking work heard from — else 503 with the reason. Against a real nats-server."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator

import httpx
import nats
import pytest
import uvicorn

from services.cli import natsd
from services.gateway.main import create_app
from tidal.schemas import codec, subjects
from tidal.schemas.messages import Heartbeat

pytestmark = pytest.mark.nats


def beat(kind: str, sid: str, status: str = "ok") -> Heartbeat:
    now = time.time()
    return Heartbeat(sid, kind, os.getpid(), now, now, status=status, model="m")


async def publish(nc: nats.NATS, hb: Heartbeat) -> None:
    await nc.publish(subjects.heartbeat(hb.kind, hb.service_id), codec.encode(hb))
    await nc.flush()


async def poll(client: httpx.AsyncClient, status: int, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        resp = await client.get("/ready")
        if resp.status_code == status or time.monotonic() > deadline:
            assert resp.status_code == status, resp.text
            body: dict = resp.json()
            return body
        await asyncio.sleep(0.1)


@pytest.fixture
async def bus() -> AsyncIterator[tuple[subprocess.Popen, str]]:
    port = natsd.free_port()
    store = tempfile.mkdtemp(prefix="tidal-test-ready-")
    proc = natsd.start_nats_server(port, store)
    try:
        yield proc, f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(store, ignore_errors=True)


async def test_ready_follows_the_bus_and_the_instances(
    bus: tuple[subprocess.Popen, str],
) -> None:
    proc, url = bus
    gw_nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    peer = await nats.connect(url)
    port = natsd.free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(gw_nc, "gw-ready"), port=port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            body = await poll(client, 503)
            assert body["status"] == "not_ready"
            assert "no scheduler heard from" in body["reason"]
            assert "no instance heard from" in body["reason"]
            assert (await client.get("/health")).status_code == 200

            await publish(peer, beat("scheduler", "scheduler-0"))
            await publish(peer, beat("instance", "instance-0", status="draining"))
            body = await poll(client, 503)
            assert body["reason"] == "no instance takes work (1 draining)"

            await publish(peer, beat("instance", "instance-0"))
            body = await poll(client, 200)
            assert body["status"] == "ready" and body["instances"] == ["instance-0"]

            await publish(peer, beat("instance", "instance-0", status="stopped"))
            body = await poll(client, 503)
            assert body["reason"] == "no instance heard from"

            await publish(peer, beat("instance", "instance-1"))
            await poll(client, 200)
            proc.kill()  # the bus goes away: not ready, but alive
            proc.wait()
            body = await poll(client, 503)
            assert "not connected to the NATS bus" in body["reason"]
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["nats_connected"] is False
    finally:
        server.should_exit = True
        await serving
        await peer.close()
