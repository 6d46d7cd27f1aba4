"""Kill -9 an instance under 16 online streams: every client still gets one complete answer.

The gateway learns that the instance is gone (the scheduler's `InstanceDown` after missed
heartbeats) and runs each of its requests again elsewhere from the prompt plus the tokens already
streamed; the client sees a pause, then the rest: no error, no repeated text.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from tests.fault.conftest import Up
from tidal_bench.faults.kit import StreamResult, stream

pytestmark = [pytest.mark.fault, pytest.mark.nats]
STREAMS = 16
MAX_TOKENS = 120


async def _streams(up: Up, kill: str) -> list[StreamResult]:
    c = openai.AsyncOpenAI(base_url=up.client.base_url, api_key="unused", max_retries=0,
                           timeout=60)  # fmt: skip
    results = [StreamResult() for _ in range(STREAMS)]
    tasks = [asyncio.create_task(stream(c, i, MAX_TOKENS, r)) for i, r in enumerate(results)]
    deadline = time.monotonic() + 30
    while not all(r.token_times or r.error for r in results):
        assert time.monotonic() < deadline, "streams did not start"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a few tokens in
    pid = await asyncio.to_thread(up.pid_of, kill)
    os.kill(pid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    await c.close()
    return results


def _max_gap(r: StreamResult) -> float:
    return max((b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)), default=0)


@pytest.mark.parametrize("kill", ["instance-0", "instance-1"])
def test_streams_on_a_killed_instance_finish_elsewhere_without_repeats(up: Up, kill: str) -> None:
    t0 = time.monotonic()
    results = asyncio.run(_streams(up, kill))
    for r in results:
        assert r.error == "", r.error
        assert r.finish == "length", r
        assert r.completion_tokens == MAX_TOKENS, r
        # the sim engine writes one word per token: a repeat would show as extra words
        assert len(r.text.split()) == MAX_TOKENS, r.text
    stalled = [g for g in map(_max_gap, results) if g > 0.5]
    longest = max(stalled, default=0.0)
    took = time.monotonic() - t0
    print(f"killed {kill}: {len(stalled)} of {STREAMS} streams paused (longest {longest:.2f} s);"
          f" all done in {took:.1f} s")  # fmt: skip
    deadline = time.monotonic() + 15  # `tidal up` notices the exit on its own schedule
    while f"{kill} (pid" not in up.log_text():
        assert time.monotonic() < deadline, up.log_text()
        time.sleep(0.2)
