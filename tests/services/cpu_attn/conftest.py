"""CPU-attention workers served on a background event loop (a real TCP data plane), and the
tiny random-weight engines of tests/tidal/engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from services.cpu_attn.server import ThreadedWorker
from services.instance.cpu_attn_link import CpuAttnPool
from tests.tidal.engine.conftest import _one_torch_thread, make_engine, tiny_dirs  # noqa: F401

WorkerThread = ThreadedWorker

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
