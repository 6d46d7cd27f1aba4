"""Operational endpoints: liveness (`/health`), readiness (`/ready`) and Prometheus metrics.

`/health` answers 200 while the process runs (a probe that restarts a gateway cut off from the
bus would not bring the bus back); `/ready` answers 200 only when the gateway can serve — bus
connected, a scheduler and an instance taking work heard from — and 503 with the reasons
otherwise, so a load balancer sends it no traffic until then."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.bus import GatewayBus
from services.gateway.dependencies import get_bus, get_metrics
from services.gateway.metrics import GatewayMetrics

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, object]:
    nc = request.app.state.nc
    return {
        "status": "ok" if nc.is_connected else "degraded",
        "nats_connected": nc.is_connected,
        "gateway_id": request.app.state.gateway_id,
    }


@router.get("/ready")
async def ready(request: Request, bus: GatewayBus = Depends(get_bus)) -> JSONResponse:
    reasons, seen = bus.readiness()
    body = {
        "status": "not_ready" if reasons else "ready",
        "reason": "; ".join(reasons),
        "gateway_id": request.app.state.gateway_id,
        **seen,
    }
    return JSONResponse(body, status_code=503 if reasons else 200)


@router.get("/metrics")
async def metrics(m: GatewayMetrics = Depends(get_metrics)) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
