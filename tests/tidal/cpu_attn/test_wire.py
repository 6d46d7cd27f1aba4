"""The CPU-attention data plane's frames."""

from __future__ import annotations

import pytest
import torch

from tidal.cpu_attn import wire


def test_frame_round_trip_with_a_bf16_payload() -> None:
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4).to(torch.bfloat16)
    data = wire.to_bytes(t)
    msg = wire.Offload(7, "r1", [2, 3, 4], "bfloat16", 5, wire.crc32(data))
    head, header, payload = wire.frame(msg, data)
    hn, pn = wire.parse_head(bytes(head))
    assert (hn, pn) == (len(header), len(payload))
    back = wire.decode(bytes(header))
    assert back == msg
    torch.testing.assert_close(wire.from_bytes(bytearray(payload), "bfloat16", [2, 3, 4]), t)


def test_bad_frames_are_value_errors() -> None:
    with pytest.raises(ValueError, match="malformed"):
        wire.decode(b"\x93garbage")
    with pytest.raises(ValueError, match="too large"):
        wire.parse_head(wire.HEAD.pack(1 << 30, 0))
    with pytest.raises(ValueError, match="does not hold"):
        wire.from_bytes(bytearray(10), "float32", [3])
    with pytest.raises(ValueError, match="unknown dtype"):
        wire.from_bytes(bytearray(4), "int8", [4])
