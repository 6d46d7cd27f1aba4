from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg

from services.cli import natsd
from services.common.bus import BusUnavailable, connect, redact, seed_urls, subscribe
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


def test_a_comma_separated_url_is_a_list_of_seeds_with_the_first_credentials() -> None:
    servers, auth = seed_urls("nats://tidal:p%40ss@n1:4222, nats://tidal:p%40ss@n2:4222,")
    assert servers == ["nats://tidal:p%40ss@n1:4222", "nats://tidal:p%40ss@n2:4222"]
    assert auth == {"user": "tidal", "password": "p@ss"}  # also for the servers announced
    assert seed_urls("nats://tok@127.0.0.1:1")[1] == {"token": "tok"}
    assert seed_urls("nats://127.0.0.1:1")[1] == {}
    assert redact("nats://u:p@a:1,nats://tok@b:2") == "nats://a:1,nats://b:2"
    with pytest.raises(ValueError, match="names no server"):
        seed_urls(" , ")


async def test_joins_a_cluster_through_any_seed(nats_url: str) -> None:
    dead = f"nats://127.0.0.1:{natsd.free_port()}"
    nc = await connect(f"{dead},{nats_url}", "test", timeout_s=10)
    assert nc.is_connected
    await nc.close()
