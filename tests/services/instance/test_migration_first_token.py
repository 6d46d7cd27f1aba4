"""A migrated request keeps the time of its first token on the target: the target's policy
counts its TPOT from there (`tidal.policy.tidal.budget`), the hand-off included, as its client
does (`MigrateOffer.first_token_unix_s`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.bus import connect
from tests.services.instance.migration_kit import (
    Gateway,
    migrate,
    running,
    sim_kind,
    start_request,
    wait_report,
)
from tidal.schemas.messages import InstanceReport

pytestmark = pytest.mark.nats


async def test_target_reports_the_first_token_time_from_the_source(nats_url: str) -> None:
    kind = sim_kind()
    async with running(nats_url, "src", 0, kind), running(nats_url, "dst", 1, kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")
        await wait_report(nc, "dst")
        gw = Gateway()
        sent = time.time()
        await start_request(nc, "src", gw, kind)  # returns once 5 tokens are out
        asked = time.time()
        res = await migrate(nc, "src", "dst")
        assert res.outcome == "ok", res
        firsts: list[float] = []

        def on_dst(rep: InstanceReport) -> bool:
            firsts.extend(r.first_token_unix_s for r in rep.requests if r.req_id == "r1")
            return bool(firsts)

        await wait_report(nc, "dst", on_dst)
        # its first token came on the source, before the migration was asked for
        assert sent < firsts[0] < asked
        await asyncio.wait_for(gw.done.wait(), 60)
        await nc.drain()
