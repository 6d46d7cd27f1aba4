"""vLLM-compatible metrics, beside the `tidal_*` ones, so dashboards, autoscalers and routers
written for vLLM (Grafana boards, the Gateway API Inference Extension's model-server protocol)
read Tidal unchanged. Same names, types, labels and units as vLLM's; buckets reach long prompts.

Per request (each gateway counts the requests it served; summing over gateways is right):
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (one sample per output
  token), vllm:e2e_request_latency_seconds, vllm:prompt_tokens_total,
  vllm:generation_tokens_total, vllm:request_success_total{finished_reason}.
Per instance, from its heartbeat (cluster state: exported by one gateway only, see
`ClusterExporter`): vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
(0-1, as vLLM's), labelled `model_name` and `engine` (the Tidal instance id).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tidal.schemas.messages import Heartbeat

# Seconds. TTFT of a 100k-token prompt on a busy instance runs to minutes; e2e of a long
# generation to tens of minutes.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30,
    80,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 240, 480, 600, 960, 1920, 3840, 7680
)  # fmt: skip
_LABELS = ["model_name"]
_INSTANCE_LABELS = ["model_name", "engine"]


class VllmMetrics:
    """`registry`: per-request series; `cluster`: per-instance gauges (exported by one gateway)."""

    def __init__(self, registry: CollectorRegistry, cluster: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, from the request reaching the gateway",
            _LABELS,
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens, one sample per token",
            _LABELS,
            buckets=ITL_BUCKETS_S,
            registry=registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, from reaching the gateway to its last token",
            _LABELS,
            buckets=E2E_BUCKETS_S,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Prompt tokens of the requests served",
            _LABELS,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Output tokens streamed to clients",
            _LABELS,
            registry=registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (stop, length, abort)",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.running = Gauge(
            "vllm:num_requests_running",
            "Requests an instance is running (holding KV and stepped)",
            _INSTANCE_LABELS,
            registry=cluster,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests queued on an instance, no KV yet",
            _INSTANCE_LABELS,
            registry=cluster,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Share of an instance's KV cache blocks in use (0-1)",
            _INSTANCE_LABELS,
            registry=cluster,
        )
        self._instances: dict[str, str] = {}  # instance id -> the model name it is exported under

    def on_instance_beat(self, hb: Heartbeat) -> None:
        if hb.status == "stopped":
            self.forget(hb.service_id)
            return
        if hb.load is None or not hb.model:
            return
        model = self._instances.get(hb.service_id)
        if model is not None and model != hb.model:  # restarted serving another model
            self.forget(hb.service_id)
        self._instances[hb.service_id] = hb.model
        load = hb.load
        self.running.labels(hb.model, hb.service_id).set(load.num_running)
        self.waiting.labels(hb.model, hb.service_id).set(load.num_waiting)
        total = load.num_kv_blocks_total
        self.kv_usage.labels(hb.model, hb.service_id).set(
            load.num_kv_blocks_used / total if total else 0.0
        )

    def forget(self, instance_id: str) -> None:
        """The instance is gone: its series go with it (a stale gauge would still count)."""
        model = self._instances.pop(instance_id, None)
        if model is None:
            return
        for gauge in (self.running, self.waiting, self.kv_usage):
            with contextlib.suppress(KeyError):
                gauge.remove(model, instance_id)
