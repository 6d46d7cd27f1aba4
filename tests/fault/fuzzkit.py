"""The one `tidal up --engine sim` (zero step time) that the HTTP-abuse and bus-garbage tests
share per module (`fuzz_up`, `http`), and their helpers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tidal_bench.faults.kit import MODEL, Stack

CHAT = [{"role": "user", "content": "hi"}]
MB = 1024 * 1024


class FuzzUp(Stack):
    """`tidal up --engine sim` with no emulated step time; `root` is its URL without /v1."""

    def __init__(self) -> None:
        super().__init__(step_model="zero")
        self.root = self.base.removesuffix("/v1")

    @property
    def nats_url(self) -> str:
        return str(json.loads((self.tmp / "up.json").read_text())["nats_url"])

    def log(self) -> str:
        return self.log_text()

    def pids(self) -> dict[str, int]:
        return {s["id"]: int(s["pid"]) for s in self.status()["services"]}


@pytest.fixture(scope="module")
def fuzz_up() -> Iterator[FuzzUp]:
    stack = FuzzUp()
    try:
        stack.wait_ready()
        deadline = time.monotonic() + 30
        while not (stack.tmp / "up.json").exists():  # written just after the API answers
            assert time.monotonic() < deadline, stack.log_text()
            time.sleep(0.1)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def http(fuzz_up: FuzzUp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_up.root, timeout=60) as client:
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
