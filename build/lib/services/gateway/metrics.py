"""Prometheus metrics of the gateway. `emulated="true"` marks timings from the sim engine."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.gateway.batch_metrics import BatchMetrics
from services.gateway.cpu_attn_metrics import CpuAttnMetrics
from tidal.engine.sglang_api import PD_MIGRATION_MODE
from tidal.schemas.messages import Heartbeat, InstanceReport, MigrationEvent

log = logging.getLogger("tidal.gateway")

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

        self.slo = Counter(
            "tidal_slo_requests",
            "Finished online requests by whether they met their TTFT and TPOT SLO "
            '(attainment = attained="true" / all)',
            ["req_class", "attained", "emulated"],
            registry=self.registry,
        )
        # Cluster-wide, from the bus (the scheduler's migration events, the instances' reports).
        self.preemptions = Counter(
            "tidal_preemptions",
            "Offline steps cut at a layer boundary for an online arrival (OOCO §3.4.1)",
            ["instance"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "tidal_migrations",
            "Migrations by kind (push: online after prefill; pull: offline decode), outcome and "
            "mode (kv: KV moved; recompute: the target recomputes prompt + output, sglang engine; "
            "pd_transfer: SGLang pushed a request's KV from its prefill to its decode server, "
            "sglang engine over a PD pair)",
            ["kind", "outcome", "mode"],
            registry=self.registry,
        )
        self.sglang_retractions = Counter(
            "tidal_sglang_retractions",
            "Running requests SGLang's own scheduler sent back to waiting (priority preemption "
            "of offline work by online work; they keep their tokens), sglang engine",
            ["instance"],
            registry=self.registry,
        )
        self.recomputes = Counter(
            "tidal_recomputes",
            "Requests run again from their prompt plus the tokens already streamed, after their "
            "instance died or their chunks were lost in a bus outage",
            ["req_class"],
            registry=self.registry,
        )
        self.migration_seconds = Histogram(
            "tidal_migration_seconds",
            "Whole migration handshake, KV transfer included, successful ones",
            ["kind"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.kv_transfer_bytes = Counter(
            "tidal_kv_transfer_bytes",
            "KV bytes moved between instances on the data plane",
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "tidal_queue_depth",
            "Requests waiting (no KV yet) on each instance, by class",
            ["instance", "req_class"],
            registry=self.registry,
        )
        self.kv_usage = Gauge(
            "tidal_kv_cache_usage_perc",
            "Share of each instance's KV blocks in use (0-1)",
            ["instance"],
            registry=self.registry,
        )
        self._preempt_seen: dict[str, int] = {}  # instance -> count in its last report
        # instance -> (its start, {info key: count}) from its last heartbeat (sglang engine)
        self._sglang_seen: dict[str, tuple[float, dict[str, int]]] = {}
        self.batch = BatchMetrics(self.registry)
        self.cpu_attn = CpuAttnMetrics(self.registry)

    def on_migration(self, ev: MigrationEvent) -> None:
        self.migrations.labels(ev.kind, ev.outcome, ev.mode).inc()
        if ev.outcome == "ok":
            self.migration_seconds.labels(ev.kind).observe(ev.total_s)
            self.kv_transfer_bytes.inc(ev.num_bytes)

    def on_instance_beat(self, hb: Heartbeat) -> None:
        """An `--engine sglang` instance counts in its heartbeat's `info` what happens inside
        SGLang: over a PD pair its prefill -> decode handoffs (`PdPairClient`), each a push
        migration carried by SGLang, and SGLang's own priority retractions. Counted here by
        what each count grew since the instance's previous beat."""
        counters = {  # info key -> the counter (and labels) its growth goes to
            "pd_transfers_total": (self.migrations, ("push", "ok", PD_MIGRATION_MODE)),
            "pd_transfer_failures_total": (self.migrations, ("push", "failed", PD_MIGRATION_MODE)),
            "sglang_retractions_total": (self.sglang_retractions, (hb.service_id,)),
        }
        if not counters.keys() & hb.info.keys():
            return
        started, seen = self._sglang_seen.get(hb.service_id, (hb.started_unix_s, {}))
        if started != hb.started_unix_s:  # restarted: its counts start again at 0
            seen = {}
        now: dict[str, int] = {}
        for key, (counter, labels) in counters.items():
            if key not in hb.info:
                continue
            raw = hb.info[key]
            try:
                now[key] = int(raw or 0)
            except ValueError:
                log.warning("%s: unreadable %s %r in its heartbeat", hb.service_id, key, raw)
                now[key] = seen.get(key, 0)  # the next readable beat counts from here
                continue
            if (grew := now[key] - seen.get(key, 0)) > 0:
                counter.labels(*labels).inc(grew)
        self._sglang_seen[hb.service_id] = (hb.started_unix_s, now)

    def on_report(self, rep: InstanceReport) -> None:
        iid = rep.instance_id
        seen = self._preempt_seen.get(iid, 0)
        if rep.num_preemptions < seen:  # the instance restarted
            seen = 0
        if rep.num_preemptions > seen:
            self.preemptions.labels(iid).inc(rep.num_preemptions - seen)
        self._preempt_seen[iid] = rep.num_preemptions
        waiting = {"online": 0, "offline": 0}
        for r in rep.requests:
            if r.phase == "waiting":
                waiting[r.req_class] = waiting.get(r.req_class, 0) + 1
        for cls, n in waiting.items():
            self.queue_depth.labels(iid, cls).set(n)
        if rep.num_blocks:
            self.kv_usage.labels(iid).set(1 - rep.num_free_blocks / rep.num_blocks)
