"""FastAPI dependencies: the bus client, metrics, batch store the lifespan put on app.state."""

from __future__ import annotations

from fastapi import Request

from services.common.batch_store import BatchStore
from services.common.protocol import ApiError
from services.gateway.bus import GatewayBus
from services.gateway.metrics import GatewayMetrics
from tidal.config.classes import ClassTable, default_table


def get_bus(request: Request) -> GatewayBus:
    bus: GatewayBus = request.app.state.bus
    return bus


def get_metrics(request: Request) -> GatewayMetrics:
    metrics: GatewayMetrics = request.app.state.metrics
    return metrics


async def get_batch_store(request: Request) -> BatchStore:
    """The JetStream batch store, opened on first use (503 while JetStream is unreachable)."""
    store: BatchStore | None = getattr(request.app.state, "batch_store", None)
    if store is None:
        try:
            store = await BatchStore.open(request.app.state.nc)
        except Exception as exc:
            raise ApiError(
                503,
                f"the batch store (NATS JetStream) is not available: {type(exc).__name__}",
                type_="server_error",
                code="batch_store_unavailable",
                retry_after_s=1,
            ) from None
        request.app.state.batch_store = store
    return store


def get_classes(request: Request) -> ClassTable:
    """The cluster's request classes (the built-in pair unless the gateway's config has some)."""
    table: ClassTable = getattr(request.app.state, "classes", None) or default_table()
    return table


def get_owner(request: Request) -> str:
    """The caller's owner id from its API key ("" when the gateway has no keys)."""
    return str(getattr(request.state, "owner", "") or "")
