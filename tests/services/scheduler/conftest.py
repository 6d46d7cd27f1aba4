"""A scheduler over a real nats-server, for the tests of its service modules."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from tests.services.scheduler.scheduler_kit import running_scheduler


@pytest.fixture(params=["aggregated"])
async def cluster(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> AsyncIterator[NATS]:
    monkeypatch.setenv("TIDAL_HEARTBEAT_S", "0.1")
    argv = ["--nats-url", nats_url, "--id", "sched-t", "--policy", request.param]
    if request.param == "aggregated":  # the roles the tests' instances report
        argv += ["--roles", "aggregated,aggregated"]
    async with running_scheduler(nats_url, argv) as nc:
        yield nc
