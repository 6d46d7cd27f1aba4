"""The one loop that reads a streamed completion and notes when its text came, on hand-built
chunks shaped as the `openai` client gives them (no server)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterable
from types import SimpleNamespace
from typing import Any

import pytest

from tidal_bench.stream_timing import StreamTimes, read_stream, read_stream_sync


def completion(text: str, finish: str | None = None, cid: str = "cmpl-1") -> Any:
    return SimpleNamespace(
        id=cid, choices=[SimpleNamespace(text=text, finish_reason=finish)], usage=None
    )


def chat(content: str | None, finish: str | None = None) -> Any:
    choice = SimpleNamespace(delta=SimpleNamespace(content=content), finish_reason=finish)
    return SimpleNamespace(id="chat-1", choices=[choice], usage=None)


def usage(tokens: int, extra: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(
        id="cmpl-1",
        choices=[],
        usage=SimpleNamespace(completion_tokens=tokens),
        model_extra=extra,
    )


async def aiter(chunks: Iterable[Any], fail: Exception | None = None) -> AsyncIterator[Any]:
    for c in chunks:
        yield c
    if fail is not None:
        raise fail


def ticks() -> Any:
    return itertools.count(10.0).__next__  # 10.0, 11.0, ... at each chunk with text


def test_each_chunk_with_text_is_timed_and_the_rest_read() -> None:
    chunks = [
        completion("", cid=""),  # a role-only opening chunk: no text, no id
        completion("eb"),
        completion("b"),
        completion(" tide", finish="length"),
        usage(4, {"tidal": {"server_ttft_ms": 1.5}}),
    ]
    got = asyncio.run(read_stream(aiter(chunks), clock=ticks()))
    assert got.times == [10.0, 11.0, 12.0]  # TTFT from 10.0, then gaps of 1.0
    assert got.text == "ebb tide" and got.finish_reason == "length"
    assert got.num_tokens == 4  # tokens, which a chunk may carry more than one of
    assert got.response_id == "cmpl-1"
    assert got.usage_extra == {"tidal": {"server_ttft_ms": 1.5}}


def test_chat_chunks_are_timed_by_their_delta_and_sync_streams_alike() -> None:
    chunks = [chat(None), chat("hi"), chat(" there", finish="stop")]
    got = read_stream_sync(chunks, clock=ticks())
    assert got.times == [10.0, 11.0] and got.text == "hi there"
    assert got.finish_reason == "stop" and got.num_tokens is None


def test_what_came_before_a_failure_stays_in_the_record_handed_in() -> None:
    got = StreamTimes()
    cut = aiter([completion("a"), completion("b")], ConnectionError())
    with pytest.raises(ConnectionError):
        asyncio.run(read_stream(cut, got, ticks()))
    assert got.times == [10.0, 11.0] and got.text == "ab"
