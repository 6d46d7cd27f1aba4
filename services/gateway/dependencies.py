"""FastAPI dependencies: the bus client, metrics and settings the lifespan put on app.state."""

from __future__ import annotations

from fastapi import Request

from services.gateway.bus_client import GatewayBus
from services.gateway.metrics import GatewayMetrics


def get_bus(request: Request) -> GatewayBus:
    bus: GatewayBus = request.app.state.bus
    return bus


def get_metrics(request: Request) -> GatewayMetrics:
    metrics: GatewayMetrics = request.app.state.metrics
    return metrics
