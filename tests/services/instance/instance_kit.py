"""One instance service (`inst-t`, the sim engine) under a given policy (`serve_instance`;
the `instance` fixture in conftest runs it under `aggregated`), and what the tests send it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from services.common.bus import connect
from services.instance import main as instance_main
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    ChatMessage,
    GenerateAck,
    GenerateRequest,
    Heartbeat,
    SamplingSpec,
)

GW = subjects.gateway_tokens("gw-test")


def make_req(req_id: str, max_tokens: int = 5, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        req_id=req_id,
        model="tidal-sim",
        sampling=SamplingSpec(max_tokens=max_tokens),
        reply_subject=GW,
        messages=[ChatMessage("user", "hello")],
        **kw,
    )  # type: ignore[arg-type]


async def submit(nc: NATS, req: GenerateRequest) -> GenerateAck:
    reply = await nc.request(subjects.instance_submit("inst-t"), codec.encode(req), timeout=2)
    return codec.decode(reply.data, GenerateAck)


async def heartbeat_load(nc: NATS) -> dict:
    """The load in the next heartbeat of the test's instance (`inst-t`), as JSON."""
    fut: asyncio.Future[Heartbeat] = asyncio.get_running_loop().create_future()

    async def on_hb(msg) -> None:  # type: ignore[no-untyped-def]
        if not fut.done():
            fut.set_result(codec.decode(msg.data, Heartbeat))

    sub = await nc.subscribe(subjects.heartbeat("instance", "inst-t"), cb=on_hb)
    hb = await asyncio.wait_for(fut, 10)
    await sub.unsubscribe()
    assert hb.load is not None
    return json.loads(codec.encode_json(hb.load))


async def serve_instance(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, policy: str, roles: str, *more: str
) -> AsyncIterator[NATS]:
    """Instance `inst-t` (slot 0) on the sim engine under `policy` and `roles` (and `more`
    flags), and a client connection to the bus."""
    monkeypatch.setenv("TIDAL_HEARTBEAT_S", "0.1")
    # 20 ms per step so a cancel lands mid-request.
    args = instance_main.parse_args(
        [
            "--nats-url",
            nats_url,
            "--id",
            "inst-t",
            "--sim-step-model",
            "linear:0.02,0,0,0",
            "--max-model-len",
            "256",
            "--policy",
            policy,
            "--roles",
            roles,
            "--tokenizer",
            "bytes",
            *more,
        ]
    )
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(args, stop))
    nc = await connect(nats_url, "test")
    await heartbeat_load(nc)  # the first heartbeat comes after the subscriptions
    try:
        yield nc
    finally:
        stop.set()
        await task
        await nc.drain()
