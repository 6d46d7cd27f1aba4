from __future__ import annotations

import pytest

from tidal.batch.objects import Batch, advance, page, to_api


def batch(status: str = "validating") -> Batch:
    return Batch(
        id="batch_1",
        endpoint="/v1/completions",
        input_file_id="file-1",
        completion_window="24h",
        status=status,
        created_at=100,
        expires_at=100 + 86400,
    )


def test_the_lifecycle_stamps_each_status() -> None:
    b = advance(batch(), "in_progress", 101.5)
    assert b.status == "in_progress" and b.in_progress_at == 101
    b = advance(advance(b, "finalizing", 102), "completed", 103)
    assert (b.finalizing_at, b.completed_at, b.is_terminal) == (102, 103, True)


@pytest.mark.parametrize(
    ("start", "to"),
    [("completed", "in_progress"), ("validating", "completed"), ("cancelled", "cancelling"),
     ("failed", "in_progress"), ("cancelling", "completed")],
)  # fmt: skip
def test_moves_openai_never_makes_are_refused(start: str, to: str) -> None:
    with pytest.raises(ValueError, match="cannot become"):
        advance(batch(start), to, 1)


def test_the_api_object_has_every_openai_field() -> None:
    body = to_api(batch())
    for key in ("id", "object", "endpoint", "errors", "input_file_id", "completion_window",
                "status", "output_file_id", "error_file_id", "created_at", "in_progress_at",
                "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                "cancelling_at", "cancelled_at", "request_counts", "metadata"):  # fmt: skip
        assert key in body
    assert body["object"] == "batch"
    assert body["request_counts"] == {"total": 0, "completed": 0, "failed": 0}


def test_pages_follow_after_and_limit() -> None:
    items = [{"id": f"x{i}"} for i in range(5)]
    p = page(items, None, 2)
    assert [d["id"] for d in p["data"]] == ["x0", "x1"] and p["has_more"]
    assert (p["first_id"], p["last_id"]) == ("x0", "x1")
    p = page(items, "x3", 2)
    assert [d["id"] for d in p["data"]] == ["x4"] and not p["has_more"]
    assert page(items, "gone", 2)["data"] == []
