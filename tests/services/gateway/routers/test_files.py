"""`GET /v1/files/{id}/content`: a store that cannot be read before the first byte is a clear
503 with Retry-After, never a response cut after its headers (a unit test of the route, with the
store standing in)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import nats.errors

from services.gateway.dependencies import get_batch_store
from services.gateway.main import create_app
from tidal.batch.objects import FileObject

FILE_ID = "file-abc"


class _Store:
    def __init__(self, chunks: list[bytes], fail_first: bool) -> None:
        self.chunks, self.fail_first = chunks, fail_first

    async def file(self, file_id: str) -> FileObject | None:
        size = sum(len(c) for c in self.chunks)
        return FileObject(id=file_id, bytes=size, created_at=0, filename="o.jsonl",
                          purpose="batch", owner="")  # fmt: skip

    async def file_chunks(self, file_id: str) -> AsyncIterator[bytes]:
        if self.fail_first:
            raise nats.errors.TimeoutError
        for c in self.chunks:
            yield c


async def _get(store: _Store) -> httpx.Response:
    app = create_app(None, "gw-files")  # type: ignore[arg-type]
    app.dependency_overrides[get_batch_store] = lambda: store
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.get(f"/v1/files/{FILE_ID}/content")


async def test_a_store_that_cannot_be_read_is_a_503_with_retry_after() -> None:
    resp = await _get(_Store([b"x" * 10], fail_first=True))
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "2"
    err = resp.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "service_unavailable"
    assert "retry" in err["message"]


async def test_the_content_is_every_chunk_in_order() -> None:
    resp = await _get(_Store([b'{"a": 1}\n', b'{"b": 2}\n'], fail_first=False))
    assert resp.status_code == 200
    assert resp.content == b'{"a": 1}\n{"b": 2}\n'
    assert resp.headers["content-length"] == str(len(resp.content))
