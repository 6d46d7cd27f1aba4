"""The one `tidal up --engine sim` (zero step time) that the HTTP-abuse and bus-garbage tests
share per module (`fuzz_up`, `http`), and their helpers."""

from __future__ import annotations

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
from typing import Any

import httpx
import pytest

from services.cli import natsd

MODEL = "tidal-sim"
REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "hi"}]
MB = 1024 * 1024


@dataclass
class FuzzUp:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    nats_url: str
    env: dict[str, str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "ctl", "status", "--json"],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        status: dict[str, Any] = json.loads(out.stdout)
        return status

    def pids(self) -> dict[str, int]:
        return {s["id"]: int(s["pid"]) for s in self.status()["services"]}


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            data: bytes = resp.read()
            return data
    except OSError:
        return None


@pytest.fixture(scope="module")
def fuzz_up() -> Iterator[FuzzUp]:
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-fuzz-"))
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json"), "TIDAL_HEARTBEAT_S": "0.2"}
    env.pop("TIDAL_NATS_URL", None)
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        "up",
        "--engine",
        "sim",
        "--port",
        str(port),
        "--cpu-attn",
        "0",
        "--sim-step-model",
        "zero",
        "--store-dir",
        str(tmp / "js"),
        "--log-level",
        "INFO",
    ]
    log_path = tmp / "up.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while b'"tidal-sim"' not in (_get(base + "/v1/models") or b""):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        while not (tmp / "up.json").exists():
            time.sleep(0.1)
        nats_url = json.loads((tmp / "up.json").read_text())["nats_url"]
        yield FuzzUp(proc, base, nats_url, env, log_path)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@pytest.fixture(scope="module")
def http(fuzz_up: FuzzUp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_up.base, timeout=60) as client:
        yield client


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **extra}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def assert_serving(up: FuzzUp, http: httpx.Client, pids: dict[str, int] | None = None) -> None:
    """Every service up (the same processes, when `pids` is given) and a request served."""
    assert up.proc.poll() is None
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    if pids is not None:
        assert up.pids() == pids, "a service died or restarted:\n" + up.log()[-4000:]


def upload(http: httpx.Client, data: bytes) -> str:
    r = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    file_id: str = r.json()["id"]
    return file_id


def wait_batch(http: httpx.Client, batch_id: str, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b: dict[str, Any] = http.get(f"/v1/batches/{batch_id}").json()
        if b["status"] in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b['status']} after {timeout_s} s")
