"""Which gateway exports the cluster's series.

Every gateway hears the same bus (instance heartbeats and reports, migration events, batch
stats), so every gateway could export the same cluster state: summed over gateways by Prometheus,
each gauge and counter would read N times its value. Instead exactly one gateway exports them:
the longest-running live gateway (lowest `(started_unix_s, id)` among those whose heartbeat came
within `STALE_BEATS` beats). Each gateway decides alone from the heartbeats it hears, so no lease
or extra bus state is needed; when the exporter dies the next one takes over a few beats later.
Per-request series (TTFT, tokens, ...) are each gateway's own and always exported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tidal.schemas.messages import Heartbeat

STALE_BEATS = 3  # a gateway silent this many heartbeat periods is no longer a candidate


class ClusterExporter:
    def __init__(self, heartbeat_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.me: tuple[float, str] = (0.0, "")  # this gateway's (started_unix_s, id)
        self.peers: dict[str, tuple[float, float]] = {}  # id -> (started_unix_s, last heard)

    def on_gateway_beat(self, hb: Heartbeat) -> None:
        if hb.service_id == self.me[1]:
            return
        if hb.status == "stopped":
            self.peers.pop(hb.service_id, None)
        else:
            self.peers[hb.service_id] = (hb.started_unix_s, self.clock())

    def is_exporter(self) -> bool:
        horizon = self.clock() - STALE_BEATS * self.heartbeat_s
        live = [(st, gid) for gid, (st, heard) in self.peers.items() if heard >= horizon]
        return all(self.me < peer for peer in live)


class WhenExporter(Collector):
    """Collects `inner`'s metrics only while this gateway is the cluster's exporter."""

    def __init__(self, inner: CollectorRegistry, exporter: ClusterExporter) -> None:
        self.inner = inner
        self.exporter = exporter

    def collect(self) -> Iterable[Metric]:
        if self.exporter.is_exporter():
            yield from self.inner.collect()
