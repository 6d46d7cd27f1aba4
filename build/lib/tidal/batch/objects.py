"""The OpenAI Batch API's objects, as they are stored and as the API returns them.

Field for field the `openai` client's `types/batch.py` and `types/file_object.py`; a batch's
status moves only along OpenAI's transitions (`advance`). Pure: timestamps are arguments.
"""

from __future__ import annotations

from typing import Any

import msgspec

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
ALL_STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *sorted(TERMINAL))

# status -> the statuses it may move to (OpenAI's lifecycle).
_NEXT: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired"}),
    "finalizing": frozenset({"completed", "expired"}),
    "cancelling": frozenset({"cancelled"}),
}
_STAMP = {
    "in_progress": "in_progress_at",
    "failed": "failed_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


class BatchError(msgspec.Struct, omit_defaults=False):
    code: str
    message: str
    line: int | None = None  # 1-based line of the input file
    param: str | None = None


class Errors(msgspec.Struct):
    data: list[BatchError]
    object: str = "list"


class RequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Usage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: dict[str, int] = msgspec.field(
        default_factory=lambda: {"cached_tokens": 0}
    )
    output_tokens_details: dict[str, int] = msgspec.field(
        default_factory=lambda: {"reasoning_tokens": 0}
    )


class Batch(msgspec.Struct):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    object: str = "batch"
    errors: Errors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: Usage | None = None
    owner: str = ""  # the API key's owner id that created it (never returned)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL


class FileObject(msgspec.Struct):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    owner: str = ""  # the API key's owner id that uploaded it (never returned)


def advance(batch: Batch, status: str, now_s: float) -> Batch:
    """`batch` moved to `status`, its timestamp set; ValueError for a move OpenAI never makes."""
    if status not in _NEXT.get(batch.status, frozenset()):
        raise ValueError(f"batch {batch.id}: {batch.status} cannot become {status}")
    out = msgspec.structs.replace(batch, status=status)
    setattr(out, _STAMP[status], int(now_s))
    return out


def to_api(obj: Batch | FileObject) -> dict[str, Any]:
    """The JSON body the API returns for `obj`."""
    out: dict[str, Any] = msgspec.to_builtins(obj)
    out.pop("owner", None)
    return out


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page over `items` (already in list order): those after id `after`."""
    if after is not None:
        ids = [it["id"] for it in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }
