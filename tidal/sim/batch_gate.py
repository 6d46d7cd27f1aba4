"""The Batch API's lines-in-flight cap, as the simulator models it.

The live batch service (`services/batch/dispatch.py`) runs at most `max_inflight` lines at once
(`tidal up --batch-max-inflight N`): a line is in flight from when the service hands it to the
cluster (routed, or held in the scheduler's queue) until it ends; the others wait in the
service's JetStream work queue, in submission order, and a line that ends frees its place for
the next. Every offline request of the simulator stands for a batch line, so `BatchGate` holds
back offline arrivals the same way; online requests never pass through it.

NOTE: a line refused by the cluster frees its place here; live, the batch service retries it
and keeps the place (the simulator's policies hold offline work rather than refuse it).
"""

from __future__ import annotations

from collections import deque

from tidal.policy.state import Phase, ReqState
from tidal.workload.mix import SimRequest

_ENDED = (Phase.FINISHED, Phase.REJECTED)


class BatchGate:
    """At most `max_inflight` offline requests in the cluster; the rest wait FIFO."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"the batch lines in flight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.inflight: list[ReqState] = []  # offline requests in the cluster, not ended
        self.queue: deque[SimRequest] = deque()  # lines waiting for a place, oldest first

    def admit(self, sr: SimRequest) -> bool:
        """True if `sr` may enter the cluster now; otherwise it waits in the queue."""
        if len(self.inflight) >= self.max_inflight:
            self._prune()
        if self.queue or len(self.inflight) >= self.max_inflight:
            self.queue.append(sr)
            return False
        return True

    def entered(self, r: ReqState) -> None:
        """`r` reaches the cluster (`admit` said yes, or `release` gave it out)."""
        self.inflight.append(r)

    def release(self) -> list[SimRequest]:
        """Drop the lines that ended; the queued lines that now have a place, oldest first."""
        if not self.queue:
            return []
        self._prune()
        out: list[SimRequest] = []
        while self.queue and len(self.inflight) + len(out) < self.max_inflight:
            out.append(self.queue.popleft())
        return out

    def _prune(self) -> None:
        self.inflight = [r for r in self.inflight if r.phase not in _ENDED]
