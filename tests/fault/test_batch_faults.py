"""Kill -9 each part of the stack in the middle of a batch: the batch still completes, and its
output has every custom_id exactly once (no line lost, none run into the output twice).

Each test has its own `tidal up --engine sim --sync-always` (it brings a killed child back) and a
200-line batch; the kill comes once some lines are done and many are still to run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.cli import natsd

pytestmark = [pytest.mark.fault, pytest.mark.nats]
MODEL = "tidal-sim"
N = 200


class Up:
    def __init__(self) -> None:
        self.port = natsd.free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="tidal-fault-"))
        self.env = {**os.environ, "TIDAL_STATE_FILE": str(self.tmp / "up.json"),
                    "TIDAL_HEARTBEAT_S": "0.2"}  # fmt: skip
        self.env.pop("TIDAL_NATS_URL", None)
        tidal = str(Path(sys.executable).parent / "tidal")
        argv = [tidal, "up", "--engine", "sim", "--port", str(self.port), "--cpu-attn", "0",
                "--sim-step-model", "linear:0.004,0.002,0,0", "--store-dir", str(self.tmp / "js"),
                "--sync-always", "--log-level", "WARNING"]  # fmt: skip
        self.log = (self.tmp / "up.log").open("w")
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(openai.APIError):
                if [m.id for m in self.client.models.list()] == [MODEL]:
                    return
            assert self.proc.poll() is None, self.log_text()
            time.sleep(0.2)
        raise AssertionError("stack not up in 60 s:\n" + self.log_text())

    def log_text(self) -> str:
        return (self.tmp / "up.log").read_text(errors="replace")

    def pid_of(self, service_id: str) -> int:
        tidal = str(Path(sys.executable).parent / "tidal")
        out = subprocess.run([tidal, "ctl", "status", "--json"], env=self.env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        for s in json.loads(out.stdout)["services"]:
            if s["id"] == service_id:
                return int(s["pid"])
        raise AssertionError(f"{service_id} not in status: {out.stdout}")

    def nats_pid(self) -> int:
        out = subprocess.run(["pgrep", "-f", f"nats-server.*{self.tmp / 'js'}"],
                             capture_output=True, text=True)  # fmt: skip
        return int(out.stdout.split()[0])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def up() -> Iterator[Up]:
    stack = Up()
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


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
    while True:  # kill once some lines are done and most are still to run
        b = c.batches.retrieve(batch.id)
        if b.request_counts is not None and b.request_counts.completed >= 10:
            break
        assert time.monotonic() < deadline, f"no progress: {b}"
        time.sleep(0.1)
    assert b.request_counts.completed < N // 2, "the batch ran too fast to kill mid-way"
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
    out = [
        json.loads(x)
        for x in _retrying(lambda: c.files.content(b.output_file_id)).text.splitlines()
    ]
    ids = [x["custom_id"] for x in out]
    assert ids == [f"f{i}" for i in range(N)], "each custom_id exactly once, in input order"
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 48 for x in out)
    assert b.request_counts is not None and b.request_counts.completed == N
    assert f"{kill} (pid {pid}) killed by SIGKILL" in up.log_text()


@pytest.mark.parametrize(
    "kill", ["batch-0", "instance-0", "gateway-0", "scheduler-0", "nats-server"]
)
def test_a_batch_survives_a_kill(up: Up, kill: str) -> None:
    _run_with_a_kill(up, kill)
