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

from tests.fault.conftest import MODEL, Up

pytestmark = [pytest.mark.fault, pytest.mark.nats]
STREAMS = 16
MAX_TOKENS = 120


async def _streams(up: Up, kill: str) -> list[dict]:
    c = openai.AsyncOpenAI(base_url=up.client.base_url, api_key="unused", max_retries=0,
                           timeout=60)  # fmt: skip
    started = asyncio.Event()
    firsts: list[float] = []

    async def one(i: int) -> dict:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, gaps, last, finish, usage = [], [], time.monotonic(), None, None
        async for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].delta.content:
                if not pieces:
                    firsts.append(now)
                    if len(firsts) == STREAMS:
                        started.set()
                pieces.append(chunk.choices[0].delta.content)
                gaps.append(now - last)
                last = now
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
        return {"text": "".join(pieces), "finish": finish, "usage": usage, "max_gap": max(gaps)}

    tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
    await asyncio.wait_for(started.wait(), timeout=30)
    await asyncio.sleep(0.3)  # a few tokens in
    pid = await asyncio.to_thread(up.pid_of, kill)
    os.kill(pid, signal.SIGKILL)
    out = await asyncio.gather(*tasks)
    await c.close()
    return out


@pytest.mark.parametrize("kill", ["instance-0", "instance-1"])
def test_streams_on_a_killed_instance_finish_elsewhere_without_repeats(up: Up, kill: str) -> None:
    t0 = time.monotonic()
    results = asyncio.run(_streams(up, kill))
    for r in results:
        assert r["finish"] == "length", r
        assert r["usage"] is not None and r["usage"].completion_tokens == MAX_TOKENS, r
        # the sim engine writes one word per token: a repeat would show as extra words
        assert len(r["text"].split()) == MAX_TOKENS, r["text"]
    stalled = [r["max_gap"] for r in results if r["max_gap"] > 0.5]
    longest = max(stalled, default=0.0)
    took = time.monotonic() - t0
    print(f"killed {kill}: {len(stalled)} of {STREAMS} streams paused (longest {longest:.2f} s);"
          f" all done in {took:.1f} s")  # fmt: skip
    deadline = time.monotonic() + 15  # `tidal up` notices the exit on its own schedule
    while f"{kill} (pid" not in up.log_text():
        assert time.monotonic() < deadline, up.log_text()
        time.sleep(0.2)
