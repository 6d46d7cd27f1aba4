"""Reading a streamed completion and noting when its text came: the clock at each chunk that
brought text, from which the benchmarks take a request's TTFT (the first, less when it was sent)
and its inter-token times (the gaps after it). One loop for the `openai` client's streams, async
(`read_stream`) or not (`read_stream_sync`), chat (`delta.content`) or completions (`text`).

The caller may hand in the record (`into`): what was read before the stream failed stays in it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamTimes:
    times: list[float] = field(default_factory=list)  # the clock at each chunk with text
    pieces: list[str] = field(default_factory=list)  # the text of those chunks
    response_id: str = ""  # the first chunk's id
    finish_reason: str | None = None  # the last one a chunk gave
    num_tokens: int | None = None  # usage.completion_tokens, when the stream carries usage
    usage_extra: dict[str, Any] | None = None  # the usage chunk's fields beyond the API's

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def read_stream(
    stream: AsyncIterable[Any],
    into: StreamTimes | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StreamTimes:
    """Read `stream` to its end, noting each chunk in `into` (a new record if None)."""
    out = StreamTimes() if into is None else into
    async for chunk in stream:
        _note(chunk, out, clock)
    return out


def read_stream_sync(
    stream: Iterable[Any],
    into: StreamTimes | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StreamTimes:
    """`read_stream` for the synchronous client."""
    out = StreamTimes() if into is None else into
    for chunk in stream:
        _note(chunk, out, clock)
    return out


def _note(chunk: Any, out: StreamTimes, clock: Callable[[], float]) -> None:
    out.response_id = out.response_id or (getattr(chunk, "id", "") or "")
    if chunk.choices:
        choice = chunk.choices[0]
        delta = getattr(choice, "delta", None)
        text = delta.content if delta is not None else getattr(choice, "text", None)
        if text:
            out.times.append(clock())
            out.pieces.append(text)
        if choice.finish_reason:
            out.finish_reason = choice.finish_reason
    if getattr(chunk, "usage", None) is not None:
        out.num_tokens = chunk.usage.completion_tokens
        out.usage_extra = getattr(chunk, "model_extra", None)
