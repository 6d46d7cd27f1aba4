"""Operational endpoints: health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.dependencies import get_metrics
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


@router.get("/metrics")
async def metrics(m: GatewayMetrics = Depends(get_metrics)) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
