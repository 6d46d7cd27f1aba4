from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from nats.aio.msg import Msg

from services.cli import natsd
from services.common.bus import (
    BusUnavailable,
    connect,
    is_local_host,
    jetstream_quorum,
    order_seeds,
    redact,
    seed_urls,
    subscribe,
)
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


def test_seeds_on_this_host_come_first_then_the_rest_in_order() -> None:
    seeds = ["nats://203.0.113.7:4222", "nats://127.0.0.1:4223", "nats://203.0.113.8:4222"]
    assert order_seeds(seeds) == [seeds[1], seeds[0], seeds[2]]
    assert is_local_host("localhost") and not is_local_host("203.0.113.7")
    assert not is_local_host("no-such-host.invalid")


async def test_jetstream_quorum_answers_on_a_node_with_jetstream(nats_url: str) -> None:
    nc = await connect(nats_url, "t")
    try:
        assert await jetstream_quorum(nc, 2.0) is True
    finally:
        await nc.close()


async def test_jetstream_quorum_is_unknown_without_jetstream() -> None:
    port = natsd.free_port()
    proc = subprocess.Popen(
        [natsd.find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert natsd.wait_for_port("127.0.0.1", port, 10)
        nc = await connect(f"nats://127.0.0.1:{port}", "t")
        try:
            assert await jetstream_quorum(nc, 2.0) is None
        finally:
            await nc.close()
    finally:
        proc.terminate()
        proc.wait(timeout=5)
