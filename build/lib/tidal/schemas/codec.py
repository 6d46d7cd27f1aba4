"""Encoding and decoding of wire messages: MessagePack for data, JSON for control."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

DecodeError = msgspec.DecodeError  # also raised for a message of the wrong shape


def encode(msg: Any) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode(data: bytes, type_: type[T]) -> T:
    """Decode MessagePack into `type_`; raises `DecodeError` if malformed or of the wrong shape."""
    return msgspec.msgpack.decode(data, type=type_)


def encode_json(msg: Any) -> bytes:
    return msgspec.json.encode(msg)


def decode_json(data: bytes, type_: type[T]) -> T:
    """Decode JSON control input. An empty payload reads as `{}` (`nats req subj ''`)."""
    return msgspec.json.decode(data.strip() or b"{}", type=type_)
