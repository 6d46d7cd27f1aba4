"""One instance service (`inst-t`, the sim engine, `aggregated`), as the `instance` fixture
(conftest) runs it, and what the tests send it."""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client as NATS

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
