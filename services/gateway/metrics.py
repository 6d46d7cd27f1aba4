"""Prometheus metrics of the gateway. `emulated="true"` marks timings from the sim engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tidal_gateway_requests",
            "Requests answered, by class, endpoint and HTTP status",
            ["req_class", "endpoint", "status"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "tidal_gateway_inflight_requests",
            "Requests being served now",
            ["req_class"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tidal_gateway_ttft_seconds",
            "Time to first token as the gateway sees it",
            ["req_class", "emulated"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "tidal_gateway_tpot_seconds",
            "Mean time per output token after the first, per request",
            ["req_class", "emulated"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "tidal_gateway_output_tokens",
            "Output tokens streamed to clients",
            ["req_class", "emulated"],
            registry=self.registry,
        )
        self.cancelled = Counter(
            "tidal_gateway_cancelled_requests",
            "Requests cancelled by a client disconnect",
            ["req_class"],
            registry=self.registry,
        )
