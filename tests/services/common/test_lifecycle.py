"""`services.common.lifecycle.wait_either`, a service's idle wait (the batch keeper's between
steps, the instance's for work): a kick or a stop ends it at once, however long the idle poll
(a stop kept waiting 5 s held the batch service's shutdown)."""

from __future__ import annotations

import asyncio
import time

from services.batch.keeper import IDLE_POLL_S
from services.common.lifecycle import wait_either


def test_a_stop_or_a_kick_ends_the_idle_wait_at_once_and_nothing_ends_it_on_time() -> None:
    async def go() -> None:
        for which in ("kick", "stop"):
            kick, stop = asyncio.Event(), asyncio.Event()
            asyncio.get_running_loop().call_later(0.1, (kick if which == "kick" else stop).set)
            t0 = time.monotonic()
            await wait_either(kick, stop, IDLE_POLL_S)
            assert time.monotonic() - t0 < 1.0, which
        t0 = time.monotonic()
        await wait_either(asyncio.Event(), asyncio.Event(), 0.2)
        assert 0.15 < time.monotonic() - t0 < 1.0
        assert len(asyncio.all_tasks()) == 1  # its waits do not linger

    asyncio.run(go())
