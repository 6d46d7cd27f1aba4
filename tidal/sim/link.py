"""The simulator's KV link: every instance has one send side and one receive side of the link's
bandwidth, and the transfers whose bytes are moving share them (processor sharing).

A transfer first spends the link's fixed cost (offer, reservation, commit: in parallel with
everything), then moves its bytes at `bytes_per_s / max(n_src, n_dst)`, where `n_src` and `n_dst`
count the transfers moving bytes out of its source and into its target; the rate changes as
transfers join and leave. This is how the live data plane behaves (each transfer its own TCP
stream; a 5 MB push next to a 234 MB one finished in 31 ms, not after it) and how TCP flows or an
RDMA NIC's queue pairs share a link; the last transfer of a burst lands when the link has moved
all its bytes either way, but a short one is no longer queued behind a long one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.policy.state import ReqState


@dataclass(eq=False, slots=True)
class Flow:
    """One KV transfer on the link."""

    req: ReqState
    src: int
    dst: int
    num_blocks: int  # reserved for it on dst
    bytes_left: float
    rate: float = 0.0  # bytes per second while it moves
    version: int = 0  # bumped whenever its end time changes (older events are stale)
    moving: bool = False  # its fixed part is over and its bytes are on the link


class SharedLink:
    """The moving transfers of a cluster and their shares of the link (`bytes_per_s` per side
    of each instance)."""

    def __init__(self, num_instances: int, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be > 0")
        self.bytes_per_s = bytes_per_s
        self.moving: list[Flow] = []
        self._num_out = [0] * num_instances
        self._num_in = [0] * num_instances
        self._t = 0.0  # when `bytes_left` of the moving transfers was last brought up to date

    def start(self, flow: Flow, now: float) -> list[Flow]:
        """`flow`'s bytes start moving; returns the transfers whose end time changed."""
        self._advance(now)
        flow.moving = True
        self.moving.append(flow)
        self._num_out[flow.src] += 1
        self._num_in[flow.dst] += 1
        return self._share()

    def finish(self, flow: Flow, now: float) -> list[Flow]:
        """`flow` has moved its last byte; returns the transfers whose end time changed."""
        self._advance(now)
        self.moving.remove(flow)
        self._num_out[flow.src] -= 1
        self._num_in[flow.dst] -= 1
        flow.bytes_left = 0.0
        return self._share()

    def end_s(self, flow: Flow) -> float:
        """When `flow` moves its last byte at its present rate."""
        return self._t + flow.bytes_left / flow.rate

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt > 0:
            for f in self.moving:
                f.bytes_left = max(0.0, f.bytes_left - f.rate * dt)
        self._t = max(self._t, now)

    def _share(self) -> list[Flow]:
        changed = []
        for f in self.moving:
            rate = self.bytes_per_s / max(self._num_out[f.src], self._num_in[f.dst])
            if rate != f.rate:
                f.rate = rate
                changed.append(f)
        return changed
