"""The sim engine's KV sink checks every byte of a chunk against the request's emulated KV."""

from __future__ import annotations

import pytest

from tidal.engine.sim.migrate import SimKvSink, SimKvSource
from tidal.engine.sim.seq import kv_digest

BPT = 57_344  # a 7B model's KV bytes per token


def pair(num_tokens: int, bpt: int = BPT) -> tuple[SimKvSource, SimKvSink]:
    digest = kv_digest(list(range(num_tokens)), num_tokens)
    return (
        SimKvSource("r", b"state", num_tokens, bpt, digest),
        SimKvSink("r", num_tokens, bpt, digest),
    )


@pytest.mark.parametrize("bpt", [BPT, 7])  # 8 bytes at a time, and byte-wise
def test_chunks_in_any_order_land_and_are_counted(bpt: int) -> None:
    src, sink = pair(200, bpt)
    sink.write(100, src.read(100, 200))
    sink.write(0, src.read(0, 100))
    assert sink.num_written == 200


@pytest.mark.parametrize("bpt", [BPT, 7])
def test_another_requests_chunk_or_one_flipped_byte_is_refused(bpt: int) -> None:
    src, sink = pair(200, bpt)
    other, _ = pair(201, bpt)  # another request's KV (another digest)
    with pytest.raises(ValueError, match="does not match"):
        sink.write(0, other.read(0, 100))  # the right size, another request's bytes
    data = bytearray(src.read(0, 100))
    data[-1] ^= 0x01
    with pytest.raises(ValueError, match="does not match"):
        sink.write(0, data)
    with pytest.raises(ValueError, match="does not fit"):
        sink.write(150, src.read(0, 100))  # past the request's tokens
    assert sink.num_written == 0
