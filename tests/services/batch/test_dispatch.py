"""`services/batch/dispatch.py` alone: a store without JetStream quorum (seconds after a
partition heals) is waited out with the job held, not nak'ed once a second until its
deliveries run out and a line that never failed goes to the error file."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import msgspec
import nats.js.errors
import pytest

from services.batch import dispatch
from services.batch.dispatch import Dispatcher, JobPayload
from services.batch.runner import Outcome


class _Store:
    def __init__(self, num_unavailable: int) -> None:
        self.num_unavailable = num_unavailable
        self.num_reads = 0

    async def batch(self, batch_id: str) -> None:
        self.num_reads += 1
        if self.num_unavailable > 0:
            self.num_unavailable -= 1
            raise nats.js.errors.ServiceUnavailableError(
                code=503, err_code=10008, description="JetStream system temporarily unavailable"
            )
        return None  # the batch is gone: the job is acknowledged and not run


class _Msg:
    def __init__(self) -> None:
        self.acks: list[str] = []

    async def ack_sync(self) -> None:
        self.acks.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.acks.append("nak")


async def test_a_store_without_quorum_is_waited_out_with_the_job_held(monkeypatch: Any) -> None:
    monkeypatch.setattr(dispatch, "RETRY_DELAY_S", 0.01)
    store, msg = _Store(num_unavailable=3), _Msg()
    d = Dispatcher(store=store, bus=None, max_inflight=1)  # type: ignore[arg-type]
    job = JobPayload("batch_x", "b0", 0, "/v1/completions", {})
    await d._run_held(job, msg)  # type: ignore[arg-type]
    assert store.num_reads == 4 and msg.acks == ["ack"]  # never put back meanwhile


async def test_other_errors_still_reach_the_caller() -> None:
    class _Broken(_Store):
        async def batch(self, batch_id: str) -> None:
            raise RuntimeError("a bug")

    d = Dispatcher(store=_Broken(0), bus=None, max_inflight=1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        await d._run_held(JobPayload("batch_x", "b0", 0, "/v1/completions", {}), _Msg())  # type: ignore[arg-type]


# ---- a line delivered again while it runs here (a copy left in nats-py's queue past its ack
# deadline): one run, not two at once; every delivery counted in flight until it is done ----


class _Batches:
    """A live batch and the results stored so far (first writer wins)."""

    def __init__(self, hold_second_ask: bool = False) -> None:
        self.results: dict[str, dict[str, Any]] = {}
        self.num_asked = 0
        self.second_ask = asyncio.Event()  # with `hold_second_ask`, the second `has_result`
        if not hold_second_ask:  # waits for it
            self.second_ask.set()

    async def batch(self, batch_id: str) -> Any:
        return SimpleNamespace(status="in_progress", expires_at=time.time() + 3600)

    async def has_result(self, batch_id: str, custom_id: str) -> bool:
        self.num_asked += 1
        if self.num_asked == 2:
            await self.second_ask.wait()
        return custom_id in self.results

    async def put_result(self, batch_id: str, custom_id: str, line: dict[str, Any]) -> bool:
        return self.results.setdefault(custom_id, line) is line


class _Delivery(_Msg):
    """One JetStream delivery of a job."""

    def __init__(self, job: JobPayload, num_delivered: int) -> None:
        super().__init__()
        self.data = msgspec.json.encode(job)
        self.metadata = SimpleNamespace(num_delivered=num_delivered)

    async def in_progress(self) -> None:
        pass

    async def ack(self) -> None:
        self.acks.append("ack")


class _Cluster:
    """`run_line` stand-in: each run waits until `finish` is set."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.finish = asyncio.Event()

    async def run_line(self, bus: Any, endpoint: str, body: Any, *args: Any) -> Outcome:
        self.runs.append(body["line"])
        await self.finish.wait()
        return Outcome(200, {"usage": {"completion_tokens": 1}}, "req", output_tokens=1)


async def _until(cond: Any) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


def _two_deliveries() -> tuple[_Delivery, _Delivery]:
    """Line "a" delivered, and delivered again once it runs."""
    job = JobPayload("batch_x", "a", 0, "/v1/completions", {"line": "a"})
    return _Delivery(job, 1), _Delivery(job, 2)


async def test_a_redelivered_line_waits_for_its_run_instead_of_running_again(
    monkeypatch: Any,
) -> None:
    cluster, store = _Cluster(), _Batches()
    monkeypatch.setattr(dispatch, "run_line", cluster.run_line)
    d = Dispatcher(store=store, bus=None, max_inflight=2)  # type: ignore[arg-type]
    first, again = _two_deliveries()
    d._start(first)  # type: ignore[arg-type]
    await _until(lambda: cluster.runs)
    d._start(again)  # type: ignore[arg-type]
    for _ in range(20):
        await asyncio.sleep(0)
    assert cluster.runs == ["a"] and d.num_inflight == 1  # one line, one request on the bus
    cluster.finish.set()
    await _until(lambda: not d.tasks)
    assert cluster.runs == ["a"] and list(store.results) == ["a"]
    assert first.acks == ["ack"] and again.acks == ["ack"]  # the same message: acked once more
    assert d.counters.done == 1 and d.num_inflight == 0


async def test_a_redelivery_keeps_its_line_in_flight_after_the_first_run_ends(
    monkeypatch: Any,
) -> None:
    cluster, store = _Cluster(), _Batches(hold_second_ask=True)
    monkeypatch.setattr(dispatch, "run_line", cluster.run_line)
    d = Dispatcher(store=store, bus=None, max_inflight=2)  # type: ignore[arg-type]
    first, again = _two_deliveries()
    d._start(first)  # type: ignore[arg-type]
    await _until(lambda: cluster.runs)
    d._start(again)  # type: ignore[arg-type]
    cluster.finish.set()
    await _until(lambda: first.acks and store.num_asked == 2)
    for _ in range(20):  # the first delivery's task ends
        await asyncio.sleep(0)
    # the redelivery, still being handled, keeps the line's place: else the dispatcher fetches
    # past what the bus takes, and a line it 429s waits behind every line fetched after it
    assert d.num_inflight == 1
    store.second_ask.set()
    await _until(lambda: not d.tasks)
    assert again.acks == ["ack"] and d.num_inflight == 0


async def test_a_line_cancelled_before_it_ran_leaves_no_place_taken() -> None:
    d = Dispatcher(store=_Batches(), bus=None, max_inflight=2)  # type: ignore[arg-type]
    d._start(_Delivery(JobPayload("batch_x", "a", 0, "/v1/completions", {}), 1))  # type: ignore[arg-type]
    assert d.num_inflight == 1
    assert await d.cancel_batch("batch_x") == 1
    await asyncio.sleep(0)
    assert d.num_inflight == 0 and not d.tasks
