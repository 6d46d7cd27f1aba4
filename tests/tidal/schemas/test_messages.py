from __future__ import annotations

import msgspec
import pytest

from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    ChatMessage,
    GenerateAck,
    GenerateRequest,
    Heartbeat,
    InstanceLoad,
    RouteReply,
    RouteRequest,
    SamplingSpec,
    TokenChunk,
)


def make_generate(**kw: object) -> GenerateRequest:
    base: dict[str, object] = dict(
        req_id="r1",
        model="m",
        sampling=SamplingSpec(max_tokens=8, stop=["\n"], seed=3),
        reply_subject=subjects.gateway_tokens("gw"),
        messages=[ChatMessage(role="user", content="hi")],
    )
    base.update(kw)
    return GenerateRequest(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "msg",
    [
        make_generate(),
        make_generate(messages=None, prompt="once upon", req_class="offline", ttft_slo_ms=250.0),
        Heartbeat(
            service_id="instance-0",
            kind="instance",
            pid=1,
            started_unix_s=1.0,
            sent_unix_s=2.0,
            role="strict",
            engine="sim",
            is_emulated=True,
            load=InstanceLoad(1, 2, 3, 4, 5, 6, num_steps=7, last_step_ms=8.5),
        ),
        RouteRequest(
            req_id="r",
            model="m",
            req_class="online",
            max_tokens=4,
            num_prompt_chars=10,
            exclude=["a"],
        ),
        RouteReply(error_code="no_capacity", message="busy", retry_after_s=1.0),
        GenerateAck(ok=True, num_prompt_tokens=12, engine="sim", is_emulated=True),
        TokenChunk(
            req_id="r",
            seq=3,
            text=" ebb",
            num_tokens=1,
            num_prompt_tokens=5,
            num_output_tokens=4,
            instance_id="i",
            finish_reason="length",
            logprobs=[-0.5],
        ),
    ],
)
def test_msgpack_round_trip_is_lossless(msg: msgspec.Struct) -> None:
    assert codec.decode(codec.encode(msg), type(msg)) == msg


def test_malformed_bytes_raise_decode_error() -> None:
    with pytest.raises(codec.DecodeError):
        codec.decode(b"\xc1not msgpack", TokenChunk)


def test_message_of_the_wrong_shape_is_rejected() -> None:
    # A RouteReply on a subject that carries TokenChunks lacks the required fields.
    with pytest.raises(msgspec.ValidationError):
        codec.decode(codec.encode(RouteReply(instance_id="i")), TokenChunk)


def test_subject_builders() -> None:
    assert subjects.heartbeat("instance", "instance-0") == "tidal.hb.instance.instance-0"
    assert subjects.instance_submit("i_1") == "tidal.inst.i_1.submit"
    assert subjects.gateway_tokens("gw-0") == "tidal.gw.gw-0.tokens"
    assert subjects.heartbeat("cpu_attn", "c").startswith("tidal.hb.")


@pytest.mark.parametrize("bad", ["", "a.b", "a*", "a>", "a b", "x" * 65])
def test_subject_tokens_reject_wildcards_and_dots(bad: str) -> None:
    with pytest.raises(ValueError, match="must be 1-64 characters"):
        subjects.instance_submit(bad)


def test_heartbeat_rejects_unknown_service_kind() -> None:
    with pytest.raises(ValueError, match="unknown service kind"):
        subjects.heartbeat("database", "x")
