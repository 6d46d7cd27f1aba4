"""`tidal_event_loop_lag_seconds{service, id}`: every service's event-loop lag histogram, from
the cumulative buckets its heartbeat carries (`services/common/looplag.py`). A service that
stopped, or has not beaten for a minute, leaves the exposition."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.looplag import BUCKETS, parse_info
from tidal.schemas.messages import Heartbeat

log = logging.getLogger(__name__)
FORGET_AFTER_S = 60.0


class LoopLagMetrics(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        # (kind, id) -> (when seen, its histogram)
        self._seen: dict[tuple[str, str], tuple[float, dict[str, object]]] = {}
        registry.register(self)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        key = (hb.kind, hb.service_id)
        if hb.status == "stopped":
            self._seen.pop(key, None)
            return
        hist = parse_info(hb.info)
        if hist is None:
            if "loop_lag" in hb.info:
                log.warning("%s %s: unreadable loop lag in its heartbeat", *key)
            return
        self._seen[key] = (time.monotonic(), hist)

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(
            "tidal_event_loop_lag_seconds",
            "How late each service's asyncio loop ran a 50 ms probe (loop blocked this long)",
            labels=["service", "id"],
        )
        now = time.monotonic()
        for (kind, sid), (seen, hist) in sorted(self._seen.items()):
            if now - seen > FORGET_AFTER_S:
                continue
            counts = hist["buckets"]
            assert isinstance(counts, list)
            bounds = [str(b) for b in BUCKETS] + ["+Inf"]
            total = hist["sum"]
            assert isinstance(total, float)
            fam.add_metric([kind, sid], list(zip(bounds, counts, strict=True)), total)
        yield fam
