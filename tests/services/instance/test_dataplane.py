"""The KV data plane at real sizes: a 2 GB request streams in bounded memory without stalling
the event loop; a corrupted chunk, a stalled peer, garbage and a full receiver each fail their
own transfer only."""

from __future__ import annotations

import asyncio
import socket
import time
import tracemalloc
from dataclasses import dataclass, field

import pytest

from services.instance.dataplane import (
    DataPlaneServer,
    TransferError,
    TransferRefused,
    parse_url,
    send_kv,
    send_kv_blocking,
)
from tidal.engine.sim.migrate import SimKvSink, SimKvSource
from tidal.engine.sim.seq import kv_digest
from tidal.schemas import kv_wire as wire

BPT = 57_344  # KV bytes per token of a 7B model (28 layers, 4 KV heads of 128, bf16)


def source(rid: str, num_tokens: int) -> SimKvSource:
    tokens = list(range(num_tokens))
    return SimKvSource(
        rid, b"state of " + rid.encode(), num_tokens, BPT, kv_digest(tokens, num_tokens)
    )


@dataclass
class Target:
    """A receiver whose sinks check every byte against the request's emulated KV."""

    done: dict[str, str] = field(default_factory=dict)  # ticket -> "" or why it failed
    sinks: dict[str, SimKvSink] = field(default_factory=dict)

    def open_transfer(self, hello: wire.Hello, state: bytes) -> SimKvSink:
        if not state.startswith(b"state of "):
            raise TransferRefused("not a request I expect")
        n = hello.num_tokens
        sink = SimKvSink(hello.ticket, n, hello.bytes_per_token, kv_digest(list(range(n)), n))
        self.sinks[hello.ticket] = sink
        return sink

    def end_transfer(self, ticket: str, error: str) -> None:
        self.done[ticket] = error


async def max_loop_lag(task: asyncio.Future[object], period_s: float = 0.01) -> float:
    worst = 0.0
    while not task.done():
        t0 = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, time.perf_counter() - t0 - period_s)
    return worst


async def test_a_2_gb_request_streams_in_bounded_memory_without_blocking_the_loop() -> None:
    target = Target()
    plane = DataPlaneServer(target)
    url = await plane.start()
    num_tokens = (2 << 30) // BPT + 1  # just over 2 GiB of KV
    tracemalloc.start()
    try:
        task = asyncio.ensure_future(send_kv(url, "big", source("big", num_tokens)))
        lag = await max_loop_lag(task)
        await task
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        await plane.close()
    assert target.done == {"big": ""}
    assert target.sinks["big"].num_written == num_tokens
    assert plane.num_bytes_received == num_tokens * BPT > 2 << 30
    # sender and receiver in this one process: a few 4-16 MiB frames, never the 2 GiB
    assert peak < 64 << 20, f"peak Python memory {peak / 2**20:.0f} MiB"
    assert lag < 0.5, f"the event loop stalled {lag:.2f} s during the transfer"


def send_corrupted(url: str, ticket: str, src: SimKvSource) -> str:
    """Like `send_kv_blocking`, with one byte of the second KV chunk flipped after its CRC."""
    host, port = parse_url(url)
    with socket.create_connection((host, port), timeout=5) as sock:
        hello = wire.encode_hello(wire.Hello(ticket, len(src.state), src.num_tokens, BPT))
        sock.sendall(wire.head(wire.HELLO, hello) + hello)
        sock.sendall(wire.head(wire.STATE, src.state) + src.state)
        per = wire.CHUNK_BYTES // BPT
        try:
            for i, start in enumerate(range(0, src.num_tokens, per)):
                data = bytearray(src.read(start, min(src.num_tokens, start + per)))
                frame = wire.head(wire.KV, data, start)
                if i == 1:
                    data[100] ^= 0xFF
                sock.sendall(frame + data)
            sock.sendall(wire.head(wire.END, b""))
            return sock.recv(4096).decode()
        except ConnectionError:  # the receiver answered and closed while we still sent
            return "error (connection closed by the receiver)"


async def test_a_corrupted_chunk_fails_its_transfer_and_the_next_one_lands() -> None:
    target = Target()
    plane = DataPlaneServer(target)
    url = await plane.start()
    try:
        answer = await asyncio.to_thread(send_corrupted, url, "bad", source("bad", 300))
        assert answer.startswith("error")
        assert "checksum" in target.done["bad"]  # the receiver says why, and drops the import
        await send_kv(url, "good", source("good", 300))
        assert target.done["good"] == ""
    finally:
        await plane.close()


async def test_a_stalled_sender_fails_alone_and_a_full_receiver_says_busy() -> None:
    target = Target()
    plane = DataPlaneServer(target, max_transfers=2, io_timeout_s=1.0)
    url = await plane.start()
    host, port = parse_url(url)
    try:
        stalled = socket.create_connection((host, port))  # opens a transfer, then says nothing
        src = source("s", 200)
        hello = wire.encode_hello(wire.Hello("s", len(src.state), src.num_tokens, BPT))
        stalled.sendall(wire.head(wire.HELLO, hello) + hello)
        # a second transfer beside it lands: the stall holds up nobody else
        await send_kv(url, "beside", source("beside", 500))
        assert target.done["beside"] == ""
        # with the stalled one and another in flight, the receiver is full and says so at once
        other = socket.create_connection((host, port))
        other.sendall(wire.head(wire.HELLO, hello) + hello)
        with pytest.raises(TransferError, match="busy"):
            await asyncio.to_thread(send_kv_blocking, url, "third", source("third", 10))
        for s in (stalled, other):  # both time out on the receiver's side
            assert s.recv(4096).startswith(b"error transfer broken")
            s.close()
        await send_kv(url, "after", source("after", 10))  # and it takes transfers again
        assert target.done["after"] == ""
    finally:
        await plane.close()


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64, b"\x01" + b"\xff" * 16, b"\x09" * 17],
)
async def test_garbage_is_refused_and_the_plane_survives(garbage: bytes) -> None:
    target = Target()
    plane = DataPlaneServer(target, io_timeout_s=1.0)
    url = await plane.start()
    host, port = parse_url(url)
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(garbage)
            assert sock.recv(4096).startswith(b"error")
        await send_kv(url, "ok", source("ok", 50))
        assert target.done == {"ok": ""}
    finally:
        await plane.close()


async def test_a_refused_transfer_reports_the_reason() -> None:
    plane = DataPlaneServer(Target())
    url = await plane.start()
    try:
        bad = SimKvSource("x", b"unexpected", 10, BPT, kv_digest(list(range(10)), 10))
        with pytest.raises(TransferError, match="not a request I expect"):
            await send_kv(url, "x", bad)
        with pytest.raises(TransferError, match="cannot reach"):
            await send_kv("tcp://127.0.0.1:1", "x", bad)
    finally:
        await plane.close()
