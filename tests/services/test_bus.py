from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg

from services.cli import natsd
from services.common.bus import BusUnavailable, connect, subscribe
from tidal.schemas import codec
from tidal.schemas.messages import CancelRequest

pytestmark = pytest.mark.nats


async def test_malformed_messages_are_dropped_and_the_subscriber_lives_on(nats_url: str) -> None:
    nc = await connect(nats_url, "test")
    got: list[str] = []

    async def handler(msg: CancelRequest, _: Msg) -> None:
        if msg.req_id == "boom":
            raise RuntimeError("handler bug")  # must not kill the subscription either
        got.append(msg.req_id)

    await subscribe(nc, "t.cancel", CancelRequest, handler)
    await nc.publish("t.cancel", b"\xc1garbage")
    await nc.publish("t.cancel", codec.encode({"unexpected": 1}))
    await nc.publish("t.cancel", codec.encode(CancelRequest(req_id="boom")))
    await nc.publish("t.cancel", codec.encode(CancelRequest(req_id="ok")))
    await nc.flush()
    for _ in range(50):
        if got:
            break
        await asyncio.sleep(0.02)
    assert got == ["ok"]
    await nc.drain()


async def test_unreachable_bus_fails_fast_with_one_line_reason() -> None:
    url = f"nats://127.0.0.1:{natsd.free_port()}"
    t0 = time.monotonic()
    with pytest.raises(BusUnavailable, match="cannot reach NATS"):
        await connect(url, "test", timeout_s=1.5)
    assert time.monotonic() - t0 < 5
