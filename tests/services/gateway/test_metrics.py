"""The gateway's metrics (`services/gateway/metrics.py`) from hand-made inputs."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.cluster_export import ClusterExporter
from services.gateway.metrics import GatewayMetrics, slo_attained
from tidal.schemas.messages import Heartbeat, InstanceLoad


def test_a_request_without_an_slo_is_not_counted_as_attained() -> None:
    assert slo_attained(5.0, 1.0, None, None) == "no_slo"


def test_a_request_is_held_to_each_target_it_has() -> None:
    assert slo_attained(0.2, 0.01, 300.0, 20.0) == "true"
    assert slo_attained(0.4, 0.01, 300.0, 20.0) == "false"  # TTFT 400 ms > 300 ms
    assert slo_attained(0.2, 0.03, 300.0, 20.0) == "false"  # TPOT 30 ms > 20 ms
    assert slo_attained(0.2, 9.0, 300.0, None) == "true"  # no TPOT target: TTFT decides


def beat(gid: str, started: float, status: str = "ok") -> Heartbeat:
    return Heartbeat(gid, "gateway", 1, started_unix_s=started, sent_unix_s=0.0, status=status)


def test_one_live_gateway_exports_the_cluster_series() -> None:
    now = [0.0]
    first, second = (ClusterExporter(1.0, clock=lambda: now[0]) for _ in range(2))
    first.me, second.me = (10.0, "g1"), (20.0, "g2")
    first.on_gateway_beat(beat("g2", 20.0))
    second.on_gateway_beat(beat("g1", 10.0))
    assert first.is_exporter() and not second.is_exporter()  # the older one
    now[0] = 2.0
    second.on_gateway_beat(beat("g1", 10.0))
    assert not second.is_exporter()
    now[0] = 5.5  # g1 silent for 3.5 beats: g2 takes over
    assert second.is_exporter()
    second.on_gateway_beat(beat("g1", 10.0, "stopped"))
    assert second.is_exporter()


def instance_beat(iid: str, running: int, waiting: int, used: int, total: int) -> Heartbeat:
    load = InstanceLoad(running, waiting, used, total, running + waiting, 0)
    return Heartbeat(iid, "instance", 1, 0.0, 0.0, model="m", load=load)


def test_instance_gauges_are_exported_once_under_vllm_names() -> None:
    m = GatewayMetrics(heartbeat_s=1.0)
    m.on_instance_beat(instance_beat("i0", 3, 2, 25, 100))
    m.on_instance_beat(instance_beat("i1", 1, 0, 10, 100))
    fams = parse(m)
    assert fams["vllm:num_requests_running"] == {("m", "i0"): 3.0, ("m", "i1"): 1.0}
    assert fams["vllm:num_requests_waiting"] == {("m", "i0"): 2.0, ("m", "i1"): 0.0}
    assert fams["vllm:kv_cache_usage_perc"] == {("m", "i0"): 0.25, ("m", "i1"): 0.1}
    m.vllm.forget("i1")  # the instance died: its series go
    assert parse(m)["vllm:num_requests_running"] == {("m", "i0"): 3.0}
    # Another gateway, up for longer, exports the cluster: this one does not.
    m.exporter.me = (50.0, "g2")
    m.exporter.on_gateway_beat(beat("g1", 10.0))
    assert "vllm:num_requests_running" not in parse(m)
    m.requests.labels("online", "/v1/chat/completions", "200").inc()
    assert "tidal_gateway_requests" in parse(m)  # its own series stay


def parse(m: GatewayMetrics) -> dict[str, dict[tuple[str, ...], float]]:
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            key = tuple(s.labels[k] for k in ("model_name", "engine") if k in s.labels)
            out.setdefault(fam.name, {})[key] = s.value
    return out


def test_batch_generated_tokens_add_up_across_a_restart() -> None:
    from prometheus_client import CollectorRegistry

    from services.gateway.batch_metrics import BatchMetrics
    from tidal.schemas.messages import BatchStats

    reg = CollectorRegistry()
    m = BatchMetrics(reg)

    def stats(started: float, generated: int) -> BatchStats:
        return BatchStats("b", started, {}, 0, 0, 0, 0, 0, 0.0, generated_tokens_total=generated)

    for st in (stats(1.0, 100), stats(1.0, 250), stats(2.0, 40)):  # the service restarted
        m.on_stats(st)
    assert reg.get_sample_value("tidal_batch_generated_tokens_total") == 290
