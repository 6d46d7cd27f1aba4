"""`batch_store._all_json`: reading every stored value with one watcher, past nats-py's early
"nothing more stored" marker."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import nats
import nats.errors
import pytest

from services.common.batch_store import LISTING_CONSUMER_TTL_S, BatchStore, _all_json
from tidal.batch.objects import FileObject


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

    async def watch(self, keys: str, **kwargs: Any) -> _Watcher:
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


@pytest.mark.nats
def test_listings_leave_no_consumers_behind(nats_url: str) -> None:
    # each listing's consumer used to outlive it by 5 min: a keeper listing a few times a
    # second hit the server's 1,000 consumers a stream, and every listing after failed
    async def main() -> int:
        nc = await nats.connect(nats_url)
        try:
            store = await BatchStore.open(nc)
            t0 = loop.time()
            for i in range(1100):
                await store.list_batches()
                # paced so the run outlasts a listing consumer's time on the server
                await asyncio.sleep(
                    max(0.0, (i + 1) * 1.3 * LISTING_CONSUMER_TTL_S / 1000 - (loop.time() - t0))
                )
            return len(await store.list_batches())
        finally:
            await nc.close()

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(main()) == 0
    finally:
        loop.close()


@pytest.mark.nats
def test_a_file_read_cut_midway_resumes_and_gives_every_byte_once(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a CI run's output download ended with 0 of 36,786 bytes: the store's consumer stopped
    # delivering after a NATS node came back, and the response died after its headers
    async def main() -> tuple[bytes, bytes, bytes, int]:
        nc = await nats.connect(nats_url)
        try:
            store = await BatchStore.open(nc)
            meta = FileObject(id=f"file-{uuid.uuid4().hex}", bytes=0, created_at=0,
                              filename="out.jsonl", purpose="batch", owner="k")  # fmt: skip
            meta = await store.put_file(meta, data)
            real_subscribe, subscriptions = store.js.subscribe, []

            async def subscribe_cut_once(*args: Any, **kwargs: Any) -> Any:
                sub = await real_subscribe(*args, **kwargs)
                subscriptions.append(sub)
                if len(subscriptions) == 1:  # the first consumer stalls after two chunks
                    real_next, given = sub.next_msg, [0]

                    async def next_msg(timeout: float) -> Any:
                        given[0] += 1
                        if given[0] > 2:
                            raise nats.errors.TimeoutError
                        return await real_next(timeout=timeout)

                    sub.next_msg = next_msg
                return sub

            monkeypatch.setattr(store.js, "subscribe", subscribe_cut_once)
            whole = b"".join([c async for c in store.file_chunks(meta.id)])
            info = await store.files.get_info(meta.id)
            tail = b"".join([c async for c in store._chunks_from(info.nuid, 200_001, len(data))])
            return whole, tail, data, len(subscriptions)
        finally:
            await nc.close()

    data = os.urandom(600_000)  # five of the store's 128 KiB chunks
    whole, tail, data, subscriptions = asyncio.run(main())
    assert whole == data and subscriptions == 3  # the cut read, its resumption, the tail
    assert tail == data[200_001:]
