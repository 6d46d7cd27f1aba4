"""The gateway's bus: the cluster's request client (`services/common/client/bus.py`) plus what
the gateway alone listens to: the metrics it exports (migrations, batch stats, CPU-attention
workers, every service's loop lag, which gateway exports the cluster's) and `/ready`."""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import subscribe
from services.common.client.bus import RequestBus
from services.common.client.stream import RequestHandle
from services.gateway.metrics import GatewayMetrics
from tidal.schemas import subjects
from tidal.schemas.messages import BatchStats, Heartbeat, InstanceReport, MigrationEvent


class GatewayBus(RequestBus):
    def __init__(
        self, nc: NATS, gateway_id: str, max_inflight: int, metrics: GatewayMetrics | None = None
    ) -> None:
        super().__init__(nc, gateway_id, max_inflight)
        self.metrics = metrics
        self._evicted: dict[str, int] = {}  # req_id -> its evictions its reports showed so far

    async def start(self) -> None:
        await super().start()
        if self.metrics is None:
            return
        await subscribe(self.nc, subjects.MIGRATION_EVENTS, MigrationEvent, self._on_mig)
        await subscribe(self.nc, subjects.BATCH_STATS, BatchStats, self._on_batch_stats)
        workers = f"{subjects.PREFIX}.hb.cpu_attn.*"
        await subscribe(self.nc, workers, Heartbeat, self._on_worker_beat)
        await subscribe(self.nc, subjects.HEARTBEAT_ALL, Heartbeat, self._on_any_beat)
        gateways = f"{subjects.PREFIX}.hb.gateway.*"  # which gateway exports the cluster's
        await subscribe(self.nc, gateways, Heartbeat, self._on_gateway_beat)

    def readiness(self) -> tuple[list[str], dict[str, object]]:
        """(why this gateway cannot serve now — empty when it can, what it sees)."""
        now = time.monotonic()
        if not self.nc.is_connected:
            # Cut off from the bus: missing beats say nothing, keep what was known.
            self.presence.extend(now)
        self.presence.expire(now)
        members = self.presence.members.values()
        instances = sorted(m.heartbeat.service_id for m in members if m.is_instance)
        taking = [
            m.heartbeat.service_id for m in members if m.is_instance and m.heartbeat.status == "ok"
        ]
        schedulers = sorted(
            m.heartbeat.service_id for m in members if m.heartbeat.kind == "scheduler"
        )
        reasons = []
        if not self.nc.is_connected:
            reasons.append("not connected to the NATS bus")
        if not schedulers:
            reasons.append("no scheduler heard from")
        if not instances:
            reasons.append("no instance heard from")
        elif not taking:
            reasons.append(f"no instance takes work ({len(instances)} draining)")
        seen = {"instances": instances, "schedulers": schedulers}
        return reasons, {"nats_connected": self.nc.is_connected, **seen}

    # ---- metrics ----

    def saw_report(self, rep: InstanceReport) -> None:
        if self.metrics is None:
            return
        self.metrics.on_report(rep)
        for r in rep.requests:  # this gateway's requests' evictions, by request class
            if not r.num_preemptions or (h := self.handles.get(r.req_id)) is None:
                continue
            seen = self._evicted.get(r.req_id, 0)
            if r.num_preemptions > seen:
                label = h.request.class_name or h.request.req_class
                self.metrics.class_preemptions.labels(label).inc(r.num_preemptions - seen)
                self._evicted[r.req_id] = r.num_preemptions

    def release(self, handle: RequestHandle) -> None:
        super().release(handle)
        self._evicted.pop(handle.request.req_id, None)

    def saw_instance_beat(self, hb: Heartbeat) -> None:
        if self.metrics is not None:
            self.metrics.on_instance_beat(hb)

    def saw_scheduler_beat(self, hb: Heartbeat) -> None:
        if self.metrics is not None:
            self.metrics.healing.on_scheduler_beat(hb)

    def saw_down(self, instance_id: str) -> None:
        if self.metrics is not None:
            self.metrics.vllm.forget(instance_id)

    def on_recompute(self, req_class: str) -> None:
        if self.metrics is not None:
            self.metrics.recomputes.labels(req_class).inc()

    async def _on_mig(self, ev: MigrationEvent, _: Msg) -> None:
        assert self.metrics is not None
        self.metrics.on_migration(ev)

    async def _on_worker_beat(self, hb: Heartbeat, _: Msg) -> None:
        assert self.metrics is not None
        self.metrics.cpu_attn.on_heartbeat(hb)

    async def _on_any_beat(self, hb: Heartbeat, _: Msg) -> None:
        assert self.metrics is not None
        self.metrics.loop_lag.on_heartbeat(hb)

    async def _on_gateway_beat(self, hb: Heartbeat, _: Msg) -> None:
        assert self.metrics is not None
        self.metrics.exporter.on_gateway_beat(hb)

    async def _on_batch_stats(self, st: BatchStats, _: Msg) -> None:
        assert self.metrics is not None
        self.metrics.batch.on_stats(st)
