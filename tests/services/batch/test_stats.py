"""The batch service's stats loop: once a second while work is under way, seldom when idle."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from services.batch import main
from tidal.schemas import codec
from tidal.schemas.messages import BatchStats


class _Store:
    """Counts the JetStream reads the loop makes (one consumer_info per round)."""

    def __init__(self, pending: int) -> None:
        self.rounds = 0
        self.pending = pending
        self.js = self

    async def consumer_info(self, *_: Any) -> Any:
        self.rounds += 1
        return types.SimpleNamespace(num_pending=self.pending)

    async def stream_info(self, *_: Any) -> Any:
        return types.SimpleNamespace(state=types.SimpleNamespace(messages=0, first_seq=0))


class _Bus:
    def __init__(self) -> None:
        self.sent: list[BatchStats] = []

    async def publish(self, _: str, data: bytes) -> None:
        self.sent.append(codec.decode(data, BatchStats))


def _parts(in_flight: int = 0, status: dict[str, int] | None = None) -> tuple[Any, Any]:
    counters = types.SimpleNamespace(done=0, failed=0, output_tokens=0, generated_tokens=0)
    dispatcher = types.SimpleNamespace(counters=counters, num_inflight=in_flight)
    return dispatcher, types.SimpleNamespace(by_status=dict(status or {}))


async def _run(store: _Store, bus: _Bus, dispatcher: Any, keeper: Any, for_s: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(main._stats_loop(bus, "b", store, dispatcher, keeper, stop))  # type: ignore[arg-type]
    await asyncio.sleep(for_s)
    stop.set()
    await task


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main, "STATS_S", 0.02)
    monkeypatch.setattr(main, "IDLE_STATS_S", 10.0)


async def test_idle_service_reads_the_store_once_not_every_second() -> None:
    store, bus = _Store(pending=0), _Bus()
    await _run(store, bus, *_parts(), for_s=0.3)
    assert store.rounds == 1 and len(bus.sent) == 1


@pytest.mark.parametrize(
    ("pending", "in_flight", "status"),
    [(5, 0, {}), (0, 2, {}), (0, 0, {"in_progress": 1})],
)
async def test_queued_in_flight_or_running_batches_are_followed_every_round(
    pending: int, in_flight: int, status: dict[str, int]
) -> None:
    store, bus = _Store(pending=pending), _Bus()
    await _run(store, bus, *_parts(in_flight, status), for_s=0.3)
    assert store.rounds >= 5


async def test_a_count_changing_while_idle_is_published_at_once() -> None:
    store, bus = _Store(pending=0), _Bus()
    dispatcher, keeper = _parts()
    stop = asyncio.Event()
    task = asyncio.create_task(main._stats_loop(bus, "b", store, dispatcher, keeper, stop))  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    sent = len(bus.sent)
    keeper.by_status = {"completed": 1}  # the keeper saw a batch end
    dispatcher.counters.done = 3
    for _ in range(500):  # a loaded machine may starve the loop for a while: wait for it
        if len(bus.sent) > sent:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await task
    assert bus.sent[-1].batches_by_status == {"completed": 1}
    assert bus.sent[-1].lines_done_total == 3
