"""The gateway's bus: per-class evictions, from its requests' rows in instance reports."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.client.stream import RequestHandle
from services.gateway.bus import GatewayBus
from services.gateway.metrics import GatewayMetrics
from tests.services.common.client.test_route_tokens import Nc
from tests.services.scheduler.test_scheduler import make_report
from tidal.schemas.messages import GenerateRequest, ReqReport, SamplingSpec


def row(rid: str, evictions: int) -> ReqReport:
    return ReqReport(rid, "online", "running", 0.0, 10, 10, 10, 1, 1,
                     num_preemptions=evictions)  # fmt: skip


def evictions(m: GatewayMetrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    return {
        s.labels["req_class"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "tidal_class_preemptions_total"
    }


def test_evictions_of_its_own_requests_count_once_under_their_class() -> None:
    m = GatewayMetrics(heartbeat_s=0.5)
    bus = GatewayBus(Nc(), "g", 8, m)  # type: ignore[arg-type]
    req = GenerateRequest("r1", "m", SamplingSpec(max_tokens=5), "x", class_name="standard")
    bus.handles["r1"] = h = RequestHandle(bus, req)  # type: ignore[arg-type]
    bus.saw_report(make_report("i0", 0, "aggregated", 1, [row("r1", 1), row("other", 5)]))
    bus.saw_report(make_report("i0", 0, "aggregated", 2, [row("r1", 1)]))  # the same one again
    assert evictions(m) == {"standard": 1.0}  # "other" is not this gateway's request
    bus.saw_report(make_report("i0", 0, "aggregated", 3, [row("r1", 3)]))
    assert evictions(m) == {"standard": 3.0}
    bus.release(h)
    assert "r1" not in bus.handles and not bus._evicted
