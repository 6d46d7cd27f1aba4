"""A running `tidal up --engine sim` that a test may kill parts of (kill -9); `tidal up` brings
each killed child back."""

from __future__ import annotations

import contextlib
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

MODEL = "tidal-sim"


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
