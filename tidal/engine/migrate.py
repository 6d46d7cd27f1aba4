"""Moving one request between engines in pieces: the engine half of push and pull migration
(OOCO §3.3), shaped like the field's transfer engines (Mooncake TE, NIXL): the KV stays in the
engines' own blocks and moves as (token range -> reserved blocks) writes, never as one buffer.

Four calls, on every engine that holds KV:

- ``begin_export(req_id) -> KvSource``: the request stops being scheduled here but keeps its KV
  blocks; ``KvSource.state`` is its small, KV-free state (tokens, sampling, progress), and
  ``KvSource.read(start, end)`` copies the KV of tokens ``[start, end)`` out of its blocks.
- ``end_export(req_id, moved)``: ``moved`` - the target runs it now, its blocks are freed here;
  otherwise it runs here again exactly as before (nothing to re-import, so nothing can fail).
- ``begin_import(state) -> KvSink``: blocks reserved for the request (``MemoryError`` when there
  is no room, ``ValueError`` for a state of another model or a corrupted one);
  ``KvSink.write(start, data)`` writes KV of tokens from ``start`` into them. Writes touch only
  the reserved blocks, so a data-plane thread may make them while the engine steps.
- ``end_import(req_id, commit)``: ``commit`` - it is scheduled here from now on (``ValueError``
  if any KV is missing); otherwise its blocks are freed.

Chunk bytes are all layers' K and V of a token range, in the engine's own layout: a chunk from
``read`` is what ``write`` takes on an engine of the same model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import msgspec

__all__ = [
    "KvSink",
    "KvSource",
    "MovableEngine",
    "OneBufferEngine",
    "WholeRequestMover",
    "chunk_ranges",
    "export_whole",
    "import_whole",
]


class KvSource(Protocol):
    req_id: str
    state: bytes  # the request without its KV (engine-specific MessagePack)
    num_tokens: int  # tokens whose KV moves
    bytes_per_token: int  # bytes each token's KV takes on the wire (0: the KV is not carried)

    def read(self, start: int, end: int) -> bytes | memoryview:
        """KV of tokens [start, end), all layers."""
        ...


class KvSink(Protocol):
    req_id: str
    num_tokens: int
    bytes_per_token: int

    def write(self, start: int, data: bytes | bytearray | memoryview) -> None:
        """KV of tokens [start, start + len(data) // bytes_per_token); ValueError if it does not
        fit the request or (emulated KV) is not the request's."""
        ...


class MovableEngine(Protocol):
    def begin_export(self, req_id: str) -> KvSource: ...

    def end_export(self, req_id: str, moved: bool) -> None: ...

    def begin_import(self, state: bytes) -> KvSink: ...

    def end_import(self, req_id: str, commit: bool) -> None: ...


def chunk_ranges(num_tokens: int, bytes_per_token: int, chunk_bytes: int) -> Iterator[range]:
    """Token ranges of at most `chunk_bytes` bytes each (one token at least); none without KV."""
    if bytes_per_token <= 0:
        return
    step = max(1, chunk_bytes // bytes_per_token)
    for start in range(0, num_tokens, step):
        yield range(start, min(num_tokens, start + step))


class _Whole(msgspec.Struct, forbid_unknown_fields=True):
    state: bytes
    kv: bytes


def export_whole(engine: MovableEngine, req_id: str, remove: bool = True) -> bytes:
    """State and all KV in one buffer: for tests, benches and engines on one host. Migration
    between instances streams instead (`services/instance/dataplane.py`)."""
    src = engine.begin_export(req_id)
    try:
        kv = bytes(src.read(0, src.num_tokens)) if src.bytes_per_token and src.num_tokens else b""
    except BaseException:
        engine.end_export(req_id, moved=False)
        raise
    engine.end_export(req_id, moved=remove)
    return msgspec.msgpack.encode(_Whole(src.state, kv))


def import_whole(engine: MovableEngine, data: bytes) -> None:
    try:
        whole = msgspec.msgpack.decode(data, type=_Whole)
    except (msgspec.MsgspecError, ValueError, TypeError) as e:
        raise ValueError(f"not a request export: {e}") from None
    sink = engine.begin_import(whole.state)
    try:
        if len(whole.kv) != sink.num_tokens * sink.bytes_per_token:
            raise ValueError(
                f"{sink.req_id!r}: KV of {len(whole.kv)} bytes, expected {sink.num_tokens} "
                f"tokens * {sink.bytes_per_token} bytes (another model, or a truncated export)"
            )
        if whole.kv:
            sink.write(0, whole.kv)
    except BaseException:
        engine.end_import(sink.req_id, commit=False)
        raise
    engine.end_import(sink.req_id, commit=True)


class _Buffered:
    """A source or sink with no KV: the whole request is its state."""

    bytes_per_token = 0
    num_tokens = 0

    def __init__(self, req_id: str, state: bytes) -> None:
        self.req_id, self.state = req_id, state

    def read(self, start: int, end: int) -> bytes:
        return b""

    def write(self, start: int, data: bytes | bytearray | memoryview) -> None:
        raise ValueError(f"{self.req_id!r} carries no KV")


class OneBufferEngine(Protocol):
    def export_request(self, req_id: str, remove: bool = True) -> bytes: ...

    def import_request(self, data: bytes) -> None: ...


class WholeRequestMover:
    """The four calls over an engine that moves a request only as one buffer without KV (the
    SGLang adapter: token ids, the target recomputes). The export leaves the engine at once, and
    a migration that does not happen imports it back."""

    def __init__(self, engine: OneBufferEngine) -> None:
        self.engine = engine
        self._out: dict[str, bytes] = {}
        self._in: dict[str, bytes] = {}
        self._num_in = 0

    def begin_export(self, req_id: str) -> KvSource:
        data = self.engine.export_request(req_id, remove=True)
        self._out[req_id] = data
        return _Buffered(req_id, data)

    def end_export(self, req_id: str, moved: bool) -> None:
        data = self._out.pop(req_id)
        if not moved:
            self.engine.import_request(data)

    def begin_import(self, state: bytes) -> KvSink:
        self._num_in += 1
        key = f"import-{self._num_in}"
        self._in[key] = state
        return _Buffered(key, state)

    def end_import(self, req_id: str, commit: bool) -> None:
        data = self._in.pop(req_id)
        if commit:
            self.engine.import_request(data)
