"""Kill -9 each part of the stack in the middle of a batch: the batch still completes, and its
output has every custom_id exactly once (no line lost, none run into the output twice).

Each test has its own `tidal up --engine sim --sync-always` (it brings a killed child back) and a
200-line batch; the kill comes once some lines are done and many are still to run.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import openai
import pytest

from tests.fault.conftest import MODEL, Up

pytestmark = [pytest.mark.fault, pytest.mark.nats]
N = 200


def _retrying(fn, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    """`fn()` until it stops failing for want of a gateway (one may be restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except (openai.APIConnectionError, openai.InternalServerError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _run_with_a_kill(up: Up, kill: str) -> None:
    c = up.client
    lines = [
        {"custom_id": f"f{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 48, "ignore_eos": True}}
        for i in range(N)
    ]  # fmt: skip
    data = "\n".join(map(json.dumps, lines)).encode()
    f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 60
    while True:  # kill once lines are done and more are still to run
        b = c.batches.retrieve(batch.id)
        if b.request_counts is not None and b.request_counts.completed >= 1:
            break
        assert time.monotonic() < deadline, f"no progress: {b}"
        time.sleep(0.1)
    # NOTE: the count moves in jumps under load (it is recounted from stored results); what
    # matters is that lines are still to run when the kill comes
    assert b.request_counts.completed < N, "the batch ended before the kill"
    pid = up.nats_pid() if kill == "nats-server" else up.pid_of(kill)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:
        b = _retrying(lambda: c.batches.retrieve(batch.id))
        if b.status in ("completed", "failed", "expired", "cancelled"):
            break
        assert time.monotonic() < deadline, f"batch stuck after killing {kill}: {b}"
        time.sleep(0.3)
    assert b.status == "completed", b
    errors = []
    if b.error_file_id:
        errors = _retrying(lambda: c.files.content(b.error_file_id)).text.splitlines()[:3]
    assert b.output_file_id is not None, f"no line succeeded: {errors}"
    out = [
        json.loads(x)
        for x in _retrying(lambda: c.files.content(b.output_file_id)).text.splitlines()
    ]
    ids = [x["custom_id"] for x in out]
    assert ids == [f"f{i}" for i in range(N)], f"each custom_id once, in order; errors: {errors}"
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 48 for x in out)
    assert b.request_counts is not None and b.request_counts.completed == N
    assert f"{kill} (pid {pid}) killed by SIGKILL" in up.log_text()


@pytest.mark.parametrize(
    "kill", ["batch-0", "instance-0", "gateway-0", "scheduler-0", "nats-server"]
)
def test_a_batch_survives_a_kill(up: Up, kill: str) -> None:
    _run_with_a_kill(up, kill)
