"""Shared fixtures: a real nats-server per test, on a free loopback port."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from services.cli import natsd


@pytest.fixture
def nats_url() -> Iterator[str]:
    """A fresh nats-server (JetStream on) for one test; stopped and cleaned up after it."""
    port = natsd.free_port()
    store = tempfile.mkdtemp(prefix="tidal-test-js-")
    proc = natsd.start_nats_server(port, store)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except Exception:
            proc.kill()
        shutil.rmtree(store, ignore_errors=True)
