"""The data plane between an instance and a CPU-attention worker: length-prefixed frames of a
MessagePack header and raw tensor bytes (KV never rides NATS).

A frame is ``HEAD`` (header length u32, payload length u64, big-endian), the header (one of the
`Message` structs below, tagged by ``kind``), then the payload. Control calls (`Offload`,
`Recall`) carry a ``call`` number their `Ok`/`Refused` reply repeats; `Attn` frames are answered
by `AttnOut` frames, in order, on the same connection (OmniServe §3.2.1: each layer sends the new
token's q, k, v and receives the attention output).

Payloads, all C-contiguous in the header's dtype:
- `Offload`: KV of every layer, (L, 2, T, Hk, D), T = num_tokens; `crc32` of the bytes.
- `Ok` to a `Recall`: the same layout, with its shape and `crc32`.
- `Attn`: (B, H + 2 Hk, D): per row the query heads, then the new token's k and v heads.
- `AttnOut`: (B, H * D): per row the attention output (rows in `errors` are zero).
"""

from __future__ import annotations

import struct
import zlib

import msgspec
import torch

HEAD = struct.Struct("!IQ")
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 16 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """A new connection's first call: the `Ok` says how much room the worker has."""

    call: int


class Offload(msgspec.Struct, tag="offload", frozen=True):
    call: int
    req_id: str
    shape: list[int]  # (L, 2, T, Hk, D)
    dtype: str
    reserve_tokens: int  # room to keep for the tokens it may still generate
    crc32: int


class Recall(msgspec.Struct, tag="recall", frozen=True):
    """Send the request's KV back (the worker keeps it until a `Drop`)."""

    call: int
    req_id: str


class Drop(msgspec.Struct, tag="drop", frozen=True):
    req_id: str


class Attn(msgspec.Struct, tag="attn", frozen=True):
    layer: int
    req_ids: list[str]
    positions: list[int]  # each row's token position (= its context length before it)
    heads: list[int]  # (H, Hk, D)
    dtype: str
    scale: float


class AttnOut(msgspec.Struct, tag="attn_out", frozen=True):
    layer: int
    req_ids: list[str]
    dtype: str
    width: int  # H * D
    errors: dict[str, str] = {}  # req_id -> why its row was not computed


class Ok(msgspec.Struct, tag="ok", frozen=True):
    call: int
    free_bytes: int
    held_tokens: int
    shape: list[int] = []  # a Recall's KV
    dtype: str = ""
    crc32: int = 0


class Refused(msgspec.Struct, tag="refused", frozen=True):
    call: int
    reason: str
    free_bytes: int = 0


Message = Hello | Offload | Recall | Drop | Attn | AttnOut | Ok | Refused
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(msg: Message, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """The buffers of one frame (write them in order, or join them)."""
    head = _encoder.encode(msg)
    return [HEAD.pack(len(head), len(payload)), head, payload]


def parse_head(prefix: bytes) -> tuple[int, int]:
    """(header bytes, payload bytes) from a frame's first `HEAD.size` bytes; ValueError when a
    peer announces more than this side accepts."""
    hn, pn = HEAD.unpack(prefix)
    if hn > MAX_HEADER_BYTES or pn > MAX_PAYLOAD_BYTES:
        raise ValueError(f"frame too large: header {hn} B, payload {pn} B")
    return hn, pn


def decode(header: bytes) -> Message:
    """ValueError for bytes that are not one of the `Message` structs."""
    try:
        return _decoder.decode(header)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed CPU-attention frame: {exc}") from None


def to_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is contiguous on the host."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def from_bytes(buf: bytes | bytearray | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over `buf` (no copy; `buf` must stay alive and writable for a bytearray).
    ValueError when the dtype is unknown or the size does not match the shape."""
    dt = DTYPES.get(dtype)
    if dt is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if any(d < 0 for d in shape):
        raise ValueError(f"bad shape {shape}")
    n = 1
    for d in shape:
        n *= d
    if n * dt.itemsize != len(buf):
        raise ValueError(f"payload of {len(buf)} B does not hold {shape} {dtype}")
    if n == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dt).view(shape)


def dtype_name(dt: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dt:
            return name
    raise ValueError(f"dtype {dt} cannot travel to a CPU-attention worker")


def crc32(buf: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(buf)
