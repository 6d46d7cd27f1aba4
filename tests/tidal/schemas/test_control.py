from __future__ import annotations

import msgspec
import pytest

from tidal.schemas import codec
from tidal.schemas.control import (
    CtlDrain,
    CtlOfflineAdmission,
    CtlPolicy,
    CtlPreempt,
    CtlPreemptReply,
    CtlRoles,
    Preempted,
)


def test_json_control_accepts_empty_payload_and_rejects_garbage() -> None:
    class Empty(msgspec.Struct):
        pass

    assert codec.decode_json(b"", Empty) == Empty()
    assert codec.decode_json(b" {} ", Empty) == Empty()
    with pytest.raises(codec.DecodeError):
        codec.decode_json(b"{not json", Empty)
    assert codec.decode_json(
        codec.encode_json(CtlOfflineAdmission(True)), CtlOfflineAdmission
    ).offline_paused


@pytest.mark.parametrize(
    "msg",
    [
        CtlPolicy(policy="ooco", params={"alpha": 0.5}, ttft_slo_s=1.0),
        CtlRoles(roles={"i0": "strict"}, chunk_sizes={"i0": 256}),
        CtlDrain(instance_id="i0", undrain=True),
        CtlPreempt(num_blocks=8, swap=True, below_priority=2),
        CtlPreemptReply(freed_blocks=8, preempted=[Preempted("r", "swap", 0)], free_ms=1.5),
    ],
)
def test_json_round_trip_is_lossless(msg: msgspec.Struct) -> None:
    assert codec.decode_json(codec.encode_json(msg), type(msg)) == msg


def test_a_preempt_signal_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(codec.DecodeError):
        codec.decode_json(b'{"num_blocks": 4, "blocks": 4}', CtlPreempt)
