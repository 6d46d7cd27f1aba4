"""A worker's data plane against bad peers: garbage or a refused call costs that connection at
most, never the worker."""

from __future__ import annotations

import socket

import pytest
import torch

from services.instance.cpu_attn_link import CpuAttnPool
from tests.services.cpu_attn.conftest import WorkerFactory
from tidal.cpu_attn import wire
from tidal.engine.api import OffloadRefused


def test_garbage_closes_only_that_connection(make_worker: WorkerFactory, pool: CpuAttnPool) -> None:
    w = make_worker()
    with socket.create_connection(("127.0.0.1", w.port), timeout=10) as s:
        s.sendall(wire.HEAD.pack(5, 0) + b"\xc1\xc1\xc1\xc1\xc1")
        assert s.recv(1) == b""  # the worker hung up on it
    pool.connect("w0", "127.0.0.1", w.port)  # and serves the next one
    kv = torch.zeros(2, 2, 3, 1, 4)
    assert pool.offload("r", kv, reserve_tokens=1) == "w0"
    torch.testing.assert_close(pool.recall("r"), kv)


def test_a_corrupt_offload_is_refused_with_the_reason(
    make_worker: WorkerFactory, pool: CpuAttnPool
) -> None:
    w = make_worker()
    pool.connect("w0", "127.0.0.1", w.port)
    conn = pool.workers["w0"]
    data = wire.to_bytes(torch.ones(1, 2, 1, 1, 4))
    reply = conn.call(
        wire.Offload,
        data,
        req_id="r",
        shape=[1, 2, 1, 1, 4],
        dtype="float32",
        reserve_tokens=1,
        crc32=wire.crc32(data) ^ 1,
    )
    assert isinstance(reply.msg, wire.Refused) and "checksum" in reply.msg.reason
    reply = conn.call(
        wire.Offload,
        data,
        req_id="r",
        shape=[9, 9],
        dtype="float32",
        reserve_tokens=1,
        crc32=wire.crc32(data),
    )
    assert isinstance(reply.msg, wire.Refused) and "bad request" in reply.msg.reason
    assert w.store.stats().num_requests == 0 and conn.alive


def test_no_workers_means_a_clear_refusal(pool: CpuAttnPool) -> None:
    with pytest.raises(OffloadRefused, match="no CPU-attention worker"):
        pool.offload("r", torch.zeros(1, 2, 1, 1, 4), reserve_tokens=1)


async def test_a_stopping_worker_ends_its_connections_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On shutdown every task is cancelled, a connection's handler among them: it ends without
    the traceback Python 3.11's stream server logs for a handler that raises its cancellation."""
    import asyncio

    from services.cpu_attn.server import AttnServer
    from tidal.cpu_attn.kv_store import KvStore

    server = AttnServer(KvStore(1 << 20))
    await server.start("127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for _ in range(100):  # the handler is reading
        if server.num_connections:
            break
        await asyncio.sleep(0.01)
    assert server.num_connections == 1
    handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in handlers:
        t.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert server.num_connections == 0
    assert "Exception in callback" not in caplog.text
    writer.close()
    await server.close()
