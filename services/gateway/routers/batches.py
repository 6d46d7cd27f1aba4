"""OpenAI Batch endpoints: /v1/batches.

Creating a batch only records it (`validating`); the batch service (`services/batch`) validates
the file, queues its lines and runs them in the cluster's slack. Cancel marks the batch
`cancelling`; the batch service aborts what is in flight and finalizes it `cancelled`.
`completion_window` is OpenAI's `24h`; as a Tidal extension any `<N>s|m|h` from 1 s to 7 days
is accepted too (tests use a short window to see expiry).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from services.common.batch_store import BatchStore
from services.common.protocol import ApiError
from services.gateway.dependencies import get_batch_store, get_owner
from services.gateway.routers.files import FILE_ID_PATTERN, owned_file
from tidal.batch.objects import ENDPOINTS, Batch, advance, page, to_api

router = APIRouter(prefix="/v1")

_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 7 * 24 * 3600
_BATCH_ID = re.compile(r"^batch_[A-Za-z0-9]{1,64}$")


class CreateBatch(BaseModel):
    input_file_id: str = Field(pattern=FILE_ID_PATTERN)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = Field(
        pattern=_WINDOW.pattern, description="'24h', or any '<N>s|m|h' from 1 s to 7 days"
    )
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None


def window_s(window: str) -> int:
    """Seconds in a completion window, or ApiError."""
    m = _WINDOW.match(window)
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise ApiError(
            400,
            f"completion_window {window!r} is not supported: use '24h' "
            "(or, on Tidal, any '<N>s', '<N>m' or '<N>h' up to 7 days)",
            param="completion_window",
        )
    return seconds


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise ApiError(400, "metadata holds at most 16 pairs", param="metadata")
    for k, v in metadata.items():
        if len(k) > 64 or len(v) > 512:
            raise ApiError(
                400, "metadata keys are at most 64 characters, values 512", param="metadata"
            )


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", code="batch_not_found", param="id")


async def _get(store: BatchStore, batch_id: str, owner: str) -> Batch:
    batch = await store.batch(batch_id) if _BATCH_ID.match(batch_id) else None
    if batch is None or batch.owner != owner:  # another key's batch: not disclosed
        raise _not_found(batch_id)
    return batch


@router.post("/batches")
async def create_batch(
    body: CreateBatch,
    store: BatchStore = Depends(get_batch_store),
    owner: str = Depends(get_owner),
) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise ApiError(
            400,
            f"endpoint {body.endpoint!r} is not supported (supported: {', '.join(ENDPOINTS)})",
            param="endpoint",
        )
    seconds = window_s(body.completion_window)
    _check_metadata(body.metadata)
    meta = await owned_file(store, body.input_file_id, owner)
    if meta is None:
        raise ApiError(
            400, f"input_file_id {body.input_file_id!r} does not exist", param="input_file_id"
        )
    if meta.purpose != "batch":
        raise ApiError(
            400,
            f"file {meta.id} was uploaded with purpose {meta.purpose!r}, not 'batch'",
            param="input_file_id",
        )
    now = int(time.time())
    batch = Batch(
        id=f"batch_{uuid.uuid4().hex}",
        endpoint=body.endpoint,
        input_file_id=meta.id,
        completion_window=body.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + seconds,
        metadata=body.metadata,
        owner=owner,
    )
    await store.create_batch(batch)
    return to_api(batch)


@router.get("/batches/{batch_id}")
async def retrieve_batch(
    batch_id: str, store: BatchStore = Depends(get_batch_store), owner: str = Depends(get_owner)
) -> dict[str, Any]:
    return to_api(await _get(store, batch_id, owner))


@router.get("/batches")
async def list_batches(
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    store: BatchStore = Depends(get_batch_store),
    owner: str = Depends(get_owner),
) -> dict[str, Any]:
    batches = [b for b in await store.list_batches() if b.owner == owner]
    batches.sort(key=lambda b: (b.created_at, b.id), reverse=True)
    return page([to_api(b) for b in batches], after, limit)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(
    batch_id: str, store: BatchStore = Depends(get_batch_store), owner: str = Depends(get_owner)
) -> dict[str, Any]:
    await _get(store, batch_id, owner)
    refused: list[str] = []

    def change(b: Batch) -> Batch | None:
        if b.status in ("cancelling", "cancelled"):
            return None
        try:
            return advance(b, "cancelling", time.time())
        except ValueError:
            refused.append(b.status)
            return None

    batch = await store.update_batch(batch_id, change)
    if refused:
        raise ApiError(
            400,
            f"cannot cancel a batch with status {refused[-1]!r}",
            code="invalid_state",
        )
    assert batch is not None
    return to_api(batch)
