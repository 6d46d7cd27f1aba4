"""`batch_store._all_json`: reading every stored value with one watcher, past nats-py's early
"nothing more stored" marker."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors

from services.common.batch_store import _all_json


class _Entry:
    def __init__(self, key: str) -> None:
        self.key, self.value, self.operation = key, b'{"k": "%s"}' % key.encode(), None


class _Watcher:
    """Yields `items` (an entry, or None for the marker), then times out as nats-py does."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.waited = 0.0

    async def updates(self, timeout: float = 5.0) -> Any:
        if self.items:
            return self.items.pop(0)
        self.waited += timeout
        raise nats.errors.TimeoutError

    async def stop(self) -> None:
        return None


class _Kv:
    def __init__(self, watcher: _Watcher) -> None:
        self.watcher = watcher

    async def watch(self, keys: str, ignore_deletes: bool = False) -> _Watcher:
        return self.watcher


def test_an_early_marker_is_read_past_and_the_listing_ends_at_the_expected_count() -> None:
    # the marker came after 1 of 3 entries; the marker comes only once, so the listing must end
    # when the third entry is in, not wait for another marker (a 10 s stall a keeper step)
    w = _Watcher([_Entry("a"), None, _Entry("b"), _Entry("c")])
    out = asyncio.run(_all_json(_Kv(w), ">", dict, expected=3))  # type: ignore[arg-type]
    assert [v["k"] for v in out] == ["a", "b", "c"] and w.waited == 0.0


def test_the_marker_ends_a_listing_that_has_every_expected_entry() -> None:
    w = _Watcher([_Entry("a"), _Entry("b"), None, _Entry("late")])
    out = asyncio.run(_all_json(_Kv(w), ">", dict, expected=2))  # type: ignore[arg-type]
    assert [v["k"] for v in out] == ["a", "b"] and w.waited == 0.0
