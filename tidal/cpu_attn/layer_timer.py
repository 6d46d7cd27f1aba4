"""`LayerTimer`: attention seconds per layer frame as Prometheus-style buckets. Torch-free, so
the gateway (control plane) reads the workers' histograms without importing the KV store."""

from __future__ import annotations

import time


class LayerTimer:
    """Attention seconds per layer frame, as cumulative histogram buckets (Prometheus style)."""

    BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.total_s = 0.0
        self.num = 0

    def observe(self, seconds: float) -> None:
        self.total_s += seconds
        self.num += 1
        for i, b in enumerate(self.BUCKETS):
            if seconds <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def timed(self) -> _Timed:
        return _Timed(self)


class _Timed:
    def __init__(self, timer: LayerTimer) -> None:
        self.timer, self.t0 = timer, 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.observe(time.perf_counter() - self.t0)
