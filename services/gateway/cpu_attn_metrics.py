"""Prometheus metrics of the CPU-attention workers (OmniServe §3.2), from their heartbeats: what
each holds, how many offloads and recalls it took, and its attention time per layer frame (the
worker keeps the histogram; its cumulative buckets ride the heartbeat). A worker that stopped,
or has not beaten for a minute, leaves the exposition."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tidal.cpu_attn.layer_timer import LayerTimer
from tidal.schemas.messages import Heartbeat

FORGET_AFTER_S = 60.0


class CpuAttnMetrics(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self._beats: dict[str, tuple[float, Heartbeat]] = {}
        registry.register(self)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        if hb.kind != "cpu_attn":
            return
        if hb.status == "stopped":
            self._beats.pop(hb.service_id, None)
        else:
            self._beats[hb.service_id] = (time.monotonic(), hb)

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        beats = [hb for t, hb in self._beats.values() if now - t < FORGET_AFTER_S]
        reqs = GaugeMetricFamily(
            "tidal_cpu_attn_offloaded_requests",
            "Requests whose KV a CPU-attention worker holds",
            labels=["worker"],
        )
        tokens = GaugeMetricFamily(
            "tidal_cpu_attn_kv_tokens", "KV tokens a CPU-attention worker holds", labels=["worker"]
        )
        offloads = CounterMetricFamily(
            "tidal_offloads", "Requests offloaded to a CPU-attention worker", labels=["worker"]
        )
        recalls = CounterMetricFamily(
            "tidal_recalls", "Requests recalled from a CPU-attention worker", labels=["worker"]
        )
        rows = CounterMetricFamily(
            "tidal_cpu_attn_rows",
            "Attention rows (one request at one layer) a CPU-attention worker computed",
            labels=["worker"],
        )
        ctx = CounterMetricFamily(
            "tidal_cpu_attn_context_tokens",
            "Context tokens those attention rows read",
            labels=["worker"],
        )
        layer = HistogramMetricFamily(
            "tidal_cpu_attn_layer_seconds",
            "Attention time of one layer frame (every offloaded row of one instance's step at "
            "that layer) on a CPU-attention worker",
            labels=["worker"],
        )
        for hb in beats:
            info, w = hb.info, [hb.service_id]
            reqs.add_metric(w, _num(info.get("offloaded_requests")))
            tokens.add_metric(w, _num(info.get("kv_tokens")))
            offloads.add_metric(w, _num(info.get("offloads_total")))
            recalls.add_metric(w, _num(info.get("recalls_total")))
            rows.add_metric(w, _num(info.get("attn_rows_total")))
            ctx.add_metric(w, _num(info.get("attn_ctx_tokens_total")))
            counts = [int(c) for c in info.get("layer_seconds_buckets", "").split(",") if c]
            if len(counts) == len(LayerTimer.BUCKETS) + 1:
                cum, buckets = 0, []
                for bound, c in zip([*map(str, LayerTimer.BUCKETS), "+Inf"], counts, strict=True):
                    cum += c
                    buckets.append((bound, float(cum)))
                layer.add_metric(w, buckets, _num(info.get("layer_seconds_sum")))
        yield from (reqs, tokens, offloads, recalls, rows, ctx, layer)


def _num(v: str | None) -> float:
    try:
        return float(v or 0)
    except ValueError:
        return 0.0
