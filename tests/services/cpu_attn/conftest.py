"""CPU-attention workers served on a background event loop (a real TCP data plane), and the
tiny random-weight engines of tests/tidal/engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from services.cpu_attn.server import AttnServer
from services.instance.cpu_attn_link import CpuAttnPool
from tests.tidal.engine.conftest import _one_torch_thread, make_engine, tiny_dirs  # noqa: F401
from tidal.cpu_attn.kv_store import KvStore


class WorkerThread:
    """One worker: an `AttnServer` over a `KvStore`, on its own loop in a thread."""

    def __init__(self, capacity_bytes: int) -> None:
        self.store = KvStore(capacity_bytes)
        self.server = AttnServer(self.store)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start("127.0.0.1", 0), self.loop).result(10)
        self.port = self.server.port

    def kill(self) -> None:
        """Close the listener and every connection, as a dead process would."""
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)

    def stop(self) -> None:
        self.kill()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


WorkerFactory = Callable[..., WorkerThread]


@pytest.fixture
def make_worker() -> Iterator[WorkerFactory]:
    made: list[WorkerThread] = []

    def make(capacity_bytes: int = 1 << 30) -> WorkerThread:
        w = WorkerThread(capacity_bytes)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


@pytest.fixture
def pool() -> Iterator[CpuAttnPool]:
    p = CpuAttnPool()
    yield p
    p.close()
