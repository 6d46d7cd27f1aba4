"""`GET /v1/batches/{id}` while JetStream has no quorum (seconds after a partition heals, a new
leader being elected): a clear 503 with Retry-After, never a 500 with a traceback (a unit test
of the route, with the store standing in)."""

from __future__ import annotations

import httpx
import nats.js.errors

from services.gateway.dependencies import get_batch_store
from services.gateway.main import create_app


class _NoQuorum:
    async def batch(self, batch_id: str) -> None:
        raise nats.js.errors.ServiceUnavailableError(
            code=503, err_code=10008, description="JetStream system temporarily unavailable"
        )


async def test_a_store_without_quorum_is_a_503_with_retry_after() -> None:
    app = create_app(None, "gw-batches")  # type: ignore[arg-type]
    app.dependency_overrides[get_batch_store] = lambda: _NoQuorum()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        resp = await client.get("/v1/batches/batch_abc")
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "2"
    err = resp.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "service_unavailable"
    assert "temporarily unavailable" in err["message"] and "retry" in err["message"]
