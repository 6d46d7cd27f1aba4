"""Framing of one KV transfer on the data plane (`services/instance/dataplane.py`).

A transfer is one TCP connection carrying frames, each a fixed 17-byte head and a payload:

    kind u8 | length u32 | offset u64 | crc32c u32      (network byte order), then `length` bytes

- ``HELLO`` (offset 0): MessagePack `Hello` - the ticket the target handed out in its offer
  reply, and the sizes that follow. The receiver answers nothing yet.
- ``STATE`` (offset = byte offset in the state): the request's KV-free state, in pieces.
- ``KV`` (offset = first token): all layers' KV of ``length / bytes_per_token`` tokens, written
  by the receiver straight into the request's reserved blocks.
- ``END`` (no payload): the sender is done; the receiver answers one line, ``ok`` or
  ``error <reason>``.

Every payload carries its CRC32C (Castagnoli, the `crc32c` package: hardware-accelerated and
GIL-free), so a corrupted chunk fails its transfer, never its request. A receiver refuses a
frame over `MAX_FRAME_BYTES`, so its memory stays bounded by a few frames whatever the request's
size; it answers ``error <reason>`` at once when it refuses a transfer.
"""

from __future__ import annotations

import struct

import crc32c
import msgspec

HEAD = struct.Struct("!BIQI")
HELLO, STATE, KV, END = 1, 2, 3, 4
KINDS = {HELLO, STATE, KV, END}
MAX_FRAME_BYTES = 16 << 20  # the most one frame may carry; senders use `CHUNK_BYTES`
CHUNK_BYTES = 4 << 20


class Hello(msgspec.Struct, forbid_unknown_fields=True):
    ticket: str
    state_bytes: int
    num_tokens: int
    bytes_per_token: int


class WireError(ValueError):
    """A frame that is malformed, too big, or fails its checksum."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    return int(crc32c.crc32c(data))


def head(kind: int, payload: bytes | bytearray | memoryview, offset: int = 0) -> bytes:
    return HEAD.pack(kind, len(payload), offset, checksum(payload))


def parse_head(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """(kind, length, offset, crc) of a frame head; WireError for an unknown kind or size."""
    kind, length, offset, crc = HEAD.unpack(raw)
    if kind not in KINDS:
        raise WireError(f"unknown frame kind {kind}")
    if length > MAX_FRAME_BYTES:
        raise WireError(f"frame of {length} bytes is over the {MAX_FRAME_BYTES} limit")
    return kind, length, offset, crc


def check(payload: bytes | bytearray | memoryview, crc: int) -> None:
    if checksum(payload) != crc:
        raise WireError("chunk checksum mismatch (corrupted in transit)")


def encode_hello(hello: Hello) -> bytes:
    return msgspec.msgpack.encode(hello)


def decode_hello(data: bytes | bytearray | memoryview) -> Hello:
    try:
        hello = msgspec.msgpack.decode(data, type=Hello)
    except (msgspec.MsgspecError, ValueError, TypeError) as e:
        raise WireError(f"malformed hello: {e}") from None
    if min(hello.state_bytes, hello.num_tokens, hello.bytes_per_token) < 0:
        raise WireError("malformed hello: negative size")
    return hello
