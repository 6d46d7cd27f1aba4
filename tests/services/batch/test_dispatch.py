"""`services/batch/dispatch.py` alone: a store without JetStream quorum (seconds after a
partition heals) is waited out with the job held, not nak'ed once a second until its
deliveries run out and a line that never failed goes to the error file."""

from __future__ import annotations

from typing import Any

import nats.js.errors
import pytest

from services.batch import dispatch
from services.batch.dispatch import Dispatcher, JobPayload


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
