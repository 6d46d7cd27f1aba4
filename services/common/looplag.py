"""How late a service's asyncio loop runs: a probe sleeps `period_s` and measures by how much it
overslept. A loop that never blocks answers within a few milliseconds; anything heavy on the
loop (a big checksum, a tokeniser, a policy over thousands of requests) shows up here first.

The histogram's cumulative buckets ride the service's heartbeat (`info["loop_lag"]`, JSON), and
the gateway exports every service's as `tidal_event_loop_lag_seconds{service, id}`."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import time
from collections import deque

import numpy as np

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
INFO_KEY = "loop_lag"


class LoopLag:
    # NOTE: a probe every 50 ms woke each of the seven services 20 times a second when idle
    # (issue 38's quiet control plane); at 250 ms a lag still shows within a quarter second
    def __init__(self, period_s: float = 0.25, window: int = 480) -> None:
        self.period_s = period_s
        self.counts = [0] * (len(BUCKETS) + 1)  # per bucket, the last one is +Inf
        self.sum_s = 0.0
        self.max_s = 0.0
        self.recent: deque[float] = deque(maxlen=window)  # for p50/p99 over the last ~2 min

    def observe(self, lag_s: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, lag_s)] += 1
        self.sum_s += lag_s
        self.max_s = max(self.max_s, lag_s)
        self.recent.append(lag_s)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period_s)
            self.observe(max(0.0, time.perf_counter() - t0 - self.period_s))

    def summary(self) -> dict[str, float]:
        """p50/p99 of the recent window, and the max since start, in seconds."""
        recent = np.asarray(self.recent or [0.0])
        return {
            "p50_s": float(np.percentile(recent, 50)),
            "p99_s": float(np.percentile(recent, 99)),
            "max_s": self.max_s,
        }

    def info(self) -> dict[str, str]:
        cumulative = np.cumsum(self.counts).tolist()
        body = {"buckets": cumulative, "sum": self.sum_s, **self.summary()}
        return {INFO_KEY: json.dumps(body, separators=(",", ":"))}


def parse_info(info: dict[str, str]) -> dict[str, object] | None:
    """The histogram a heartbeat carries; None if absent or malformed (logged by the caller)."""
    raw = info.get(INFO_KEY)
    if raw is None:
        return None
    try:
        body = json.loads(raw)
        buckets = [int(b) for b in body["buckets"]]
        if len(buckets) != len(BUCKETS) + 1 or buckets != sorted(buckets):
            return None
        return {"buckets": buckets, "sum": float(body["sum"]), "max_s": float(body["max_s"])}
    except (ValueError, KeyError, TypeError):
        return None
