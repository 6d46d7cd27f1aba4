"""Prometheus metrics of the gateway. `emulated="true"` marks timings from the sim engine.

Two kinds: the requests this gateway served (its own, in `registry`), and the cluster's state
heard on the bus (instances, migrations, batches, CPU-attention workers: in `cluster`, exported
by one gateway only, `ClusterExporter`). vLLM's names are exported beside ours (`VllmMetrics`).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.gateway.batch_metrics import BatchMetrics
from services.gateway.cluster_export import ClusterExporter, WhenExporter
from services.gateway.cpu_attn_metrics import CpuAttnMetrics
from services.gateway.healing_metrics import HealingMetrics
from services.gateway.loop_metrics import LoopLagMetrics
from services.gateway.vllm_metrics import TTFT_BUCKETS_S, VllmMetrics
from tidal import envs
from tidal.schemas.messages import PD_MIGRATION_MODE, Heartbeat, InstanceReport, MigrationEvent

log = logging.getLogger("tidal.gateway")

_LATENCY_BUCKETS_S = TTFT_BUCKETS_S  # to ~20 min: long prompts' TTFT, long migrations


def slo_attained(
    ttft_s: float, tpot_s: float, ttft_slo_ms: float | None, tpot_slo_ms: float | None
) -> str:
    """The `attained` label of a finished online request: "true" / "false" against the targets
    it is held to, or "no_slo" when it has none (never counted as met: an attainment that
    cannot fail says nothing)."""
    if ttft_slo_ms is None and tpot_slo_ms is None:
        return "no_slo"
    ttft_ok = ttft_slo_ms is None or ttft_s * 1e3 <= ttft_slo_ms
    tpot_ok = tpot_slo_ms is None or tpot_s * 1e3 <= tpot_slo_ms
    return "true" if ttft_ok and tpot_ok else "false"


class GatewayMetrics:
    def __init__(self, heartbeat_s: float | None = None) -> None:
        self.registry = CollectorRegistry()
        self.cluster = CollectorRegistry()
        self.exporter = ClusterExporter(heartbeat_s or envs.heartbeat_s())
        self.registry.register(WhenExporter(self.cluster, self.exporter))
        self.vllm = VllmMetrics(self.registry, self.cluster)
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
            "Finished online requests by whether they met their TTFT and TPOT SLO: the request's "
            'own (X-Tidal-* headers or body), else the scheduler\'s default; attained="no_slo" '
            'when neither exists (attainment = attained="true" / (true + false))',
            ["req_class", "attained", "emulated"],
            registry=self.registry,
        )
        # Request classes (docs/classes.md): `req_class` above is the class a request ran in.
        self.demotions = Counter(
            "tidal_class_demotions",
            "Requests that ran in a looser class than they asked for (their class was full or "
            "the scheduler refused it), by the class asked and the class served",
            ["from_class", "to_class"],
            registry=self.registry,
        )
        self.class_preemptions = Counter(
            "tidal_class_preemptions",
            "This gateway's requests evicted from GPU KV to be recomputed later, by the class "
            "they run in, as their instances' reports show it (one that finishes before its "
            "next report is not seen)",
            ["req_class"],
            registry=self.registry,
        )
        self.class_rejections = Counter(
            "tidal_class_rejections",
            "Requests turned away with a 429 because no class of their demotion chain could "
            "take them, by the class asked",
            ["req_class"],
            registry=self.registry,
        )
        # Cluster-wide, from the bus (the scheduler's migration events, the instances' reports).
        self.preemptions = Counter(
            "tidal_preemptions",
            "Offline steps cut at a layer boundary for an online arrival (OOCO §3.4.1)",
            ["instance"],
            registry=self.cluster,
        )
        self.plan_refusals = Counter(
            "tidal_plan_refusals",
            "Step plans an instance refused, by reason (`tidal.plan.RefusalReason`; nothing of a "
            "refused plan is carried out, docs/plan-contract.md)",
            ["instance", "reason"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "tidal_migrations",
            "Migrations by kind (push: online after prefill; pull: offline decode), outcome and "
            "mode (kv: KV moved; recompute: the target recomputes prompt + output, sglang engine; "
            "pd_transfer: SGLang pushed a request's KV from its prefill to its decode server, "
            "sglang engine over a PD pair)",
            ["kind", "outcome", "mode"],
            registry=self.cluster,
        )
        self.sglang_retractions = Counter(
            "tidal_sglang_retractions",
            "Running requests SGLang's own scheduler sent back to waiting (priority preemption "
            "of offline work by online work; they keep their tokens), sglang engine",
            ["instance"],
            registry=self.cluster,
        )
        self.recomputes = Counter(
            "tidal_recomputes",
            "Requests run again from their prompt plus the tokens already streamed, after their "
            "instance died or their chunks were lost in a bus outage",
            ["req_class"],
            registry=self.cluster,
        )
        self.migration_seconds = Histogram(
            "tidal_migration_seconds",
            "Whole migration handshake, KV transfer included, successful ones",
            ["kind"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.cluster,
        )
        self.kv_transfer_bytes = Counter(
            "tidal_kv_transfer_bytes",
            "KV bytes moved between instances on the data plane",
            registry=self.cluster,
        )
        self.queue_depth = Gauge(
            "tidal_queue_depth",
            "Requests waiting (no KV yet) on each instance, by class",
            ["instance", "req_class"],
            registry=self.cluster,
        )
        self.kv_usage = Gauge(
            "tidal_kv_cache_usage_perc",
            "Share of each instance's KV blocks in use (0-1)",
            ["instance"],
            registry=self.cluster,
        )
        self._preempt_seen: dict[str, int] = {}  # instance -> count in its last report
        self._refusals_seen: dict[str, dict[str, int]] = {}  # instance -> reason -> count
        # instance -> (its start, {info key: count}) from its last heartbeat (sglang engine)
        self._sglang_seen: dict[str, tuple[float, dict[str, int]]] = {}
        self.loop_lag = LoopLagMetrics(self.registry)
        self.healing = HealingMetrics(self.registry)
        # cluster state, exported by one gateway only (`WhenExporter`), as the Batch API and the
        # CPU-attention workers are one per cluster, not per gateway
        self.batch = BatchMetrics(self.cluster)
        self.cpu_attn = CpuAttnMetrics(self.cluster)

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
        self.vllm.on_instance_beat(hb)
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
        seen_r = self._refusals_seen.get(iid, {})
        if any(n < seen_r.get(why, 0) for why, n in rep.plan_refusals.items()):
            seen_r = {}  # the instance restarted
        for why, n in rep.plan_refusals.items():
            if n > seen_r.get(why, 0):
                self.plan_refusals.labels(iid, why).inc(n - seen_r.get(why, 0))
        self._refusals_seen[iid] = dict(rep.plan_refusals)
        waiting = {"online": 0, "offline": 0}
        for r in rep.requests:
            if r.phase == "waiting":
                waiting[r.req_class] = waiting.get(r.req_class, 0) + 1
        for cls, n in waiting.items():
            self.queue_depth.labels(iid, cls).set(n)
        if rep.num_blocks:
            self.kv_usage.labels(iid).set(1 - rep.num_free_blocks / rep.num_blocks)
