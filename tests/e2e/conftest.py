"""The embedded stack (`tidal up --engine sim`) as a user starts it, driven by real clients."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cli import natsd


@dataclass
class Stack:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT/v1
    env: dict[str, str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        tidal = str(Path(sys.executable).parent / "tidal")
        return subprocess.run(
            [tidal, "ctl", *args], env=self.env, capture_output=True, text=True, timeout=30
        )

    def status(self) -> dict:
        out = self.ctl("status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


def _get(url: str, api_key: str = "") -> bytes | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=1
        ) as resp:
            return resp.read()
    except OSError:
        return None


def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with start_stack() as st:
        yield st


@contextlib.contextmanager
def start_stack(*extra: str, api_key: str = "") -> Iterator[Stack]:
    """`tidal up --engine sim` (3 ms steps) on a free port, with `extra` arguments (`api_key`:
    one of the keys they give the gateway, to ask it whether it is up)."""
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-e2e-"))
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json"), "TIDAL_HEARTBEAT_S": "0.2"}
    env.pop("TIDAL_NATS_URL", None)
    log_path = tmp / "up.log"
    tidal = str(Path(sys.executable).parent / "tidal")
    # 3 ms per emulated step: streams last long enough to disconnect from mid-way.
    argv = [
        tidal,
        "up",
        "--engine",
        "sim",
        "--port",
        str(port),
        "--sim-step-model",
        "linear:0.003,0,0,0",
        "--log-level",
        "WARNING",
        "--store-dir",
        str(tmp / "jetstream"),
        *extra,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until(
            lambda: b'"tidal-sim"' in (_get(base + "/models", api_key) or b""), 60, "tidal up"
        )
        wait_until(lambda: (tmp / "up.json").exists(), 10, "the state file")
        yield Stack(proc, base, env, log_path)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
