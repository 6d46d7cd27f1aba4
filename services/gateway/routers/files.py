"""OpenAI Files endpoints for batch input and output: /v1/files.

Content goes into the JetStream Object Store in chunks (an upload is never one NATS message);
the file object sits beside it in a KV bucket. Only `purpose=batch` is accepted.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import nats.errors
from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse

from services.common.batch_store import BatchStore
from services.common.protocol import ApiError
from services.gateway.dependencies import get_batch_store, get_owner
from tidal.batch.objects import FileObject, page, to_api

router = APIRouter(prefix="/v1")

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
PURPOSES = ("batch",)
FILE_ID_PATTERN = r"^file-[A-Za-z0-9_-]{1,64}$"
_FILE_ID = re.compile(FILE_ID_PATTERN)


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", code="file_not_found", param="id")


def check_file_id(file_id: str) -> str:
    if not _FILE_ID.match(file_id):
        raise _not_found(file_id)
    return file_id


async def owned_file(store: BatchStore, file_id: str, owner: str) -> FileObject | None:
    """The file if it exists and belongs to `owner` (another key's file is as good as absent)."""
    meta = await store.file(check_file_id(file_id))
    return meta if meta is not None and meta.owner == owner else None


@router.post("/files")
async def upload_file(
    file: Annotated[UploadFile, File()],
    purpose: Annotated[Literal["batch"], Form()],
    store: BatchStore = Depends(get_batch_store),
    owner: str = Depends(get_owner),
) -> dict[str, Any]:
    if purpose not in PURPOSES:
        raise ApiError(
            400,
            f"purpose {purpose!r} is not supported here (supported: {', '.join(PURPOSES)})",
            param="purpose",
        )
    size = file.size if file.size is not None else 0
    if size > MAX_FILE_BYTES:
        raise ApiError(413, f"the file is over {MAX_FILE_BYTES} bytes", param="file",
                       code="request_too_large")  # fmt: skip
    meta = FileObject(
        id=f"file-{uuid.uuid4().hex}",
        bytes=size,
        created_at=int(time.time()),
        filename=file.filename or "upload.jsonl",
        purpose=purpose,
        owner=owner,
    )
    await file.seek(0)
    stored = await store.put_file(meta, file.file)  # type: ignore[arg-type]
    return to_api(stored)


@router.get("/files")
async def list_files(
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
    store: BatchStore = Depends(get_batch_store),
    owner: str = Depends(get_owner),
) -> dict[str, Any]:
    files = [
        f
        for f in await store.list_files()
        if f.owner == owner and (purpose is None or f.purpose == purpose)
    ]
    files.sort(key=lambda f: (f.created_at, f.id), reverse=order == "desc")
    return page([to_api(f) for f in files], after, limit)


@router.get("/files/{file_id}")
async def retrieve_file(
    file_id: str, store: BatchStore = Depends(get_batch_store), owner: str = Depends(get_owner)
) -> dict[str, Any]:
    meta = await owned_file(store, file_id, owner)
    if meta is None:
        raise _not_found(file_id)
    return to_api(meta)


@router.get("/files/{file_id}/content")
async def file_content(
    file_id: str, store: BatchStore = Depends(get_batch_store), owner: str = Depends(get_owner)
) -> StreamingResponse:
    meta = await owned_file(store, file_id, owner)
    if meta is None:
        raise _not_found(file_id)

    chunks = store.file_chunks(file_id)
    try:  # the first bytes before the headers: a store that cannot be read is a clear 503
        first = await anext(chunks) if meta.bytes else b""
    except (TimeoutError, nats.errors.Error) as e:  # the generator has ended with it
        raise ApiError(503, f"the file store could not be read ({e!r}); retry shortly",
                       type_="server_error", code="service_unavailable",
                       retry_after_s=2.0) from e  # fmt: skip

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return StreamingResponse(
        body(),
        media_type="application/octet-stream",
        headers={"Content-Length": str(meta.bytes)},
    )


@router.delete("/files/{file_id}")
async def delete_file(
    file_id: str, store: BatchStore = Depends(get_batch_store), owner: str = Depends(get_owner)
) -> dict[str, Any]:
    if await owned_file(store, file_id, owner) is None or not await store.delete_file(file_id):
        raise _not_found(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
