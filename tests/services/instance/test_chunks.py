"""An offline request's tokens held back and merged into one `TokenChunk` (no server)."""

from __future__ import annotations

import pytest

from services.common.client import resync
from services.instance import main as instance_main
from services.instance.chunks import MAX_AGE_LIMIT_S, Coalescing, Stream, merge
from tidal.schemas.messages import TokenChunk


def make_chunk(i: int, **kw: object) -> TokenChunk:
    """The chunk of token `i` (its id 100 + i, its text "t{i}") of request "r"."""
    fields: dict[str, object] = {
        "req_id": "r",
        "seq": 0,
        "text": f"t{i}",
        "num_tokens": 1,
        "num_prompt_tokens": 7,
        "num_output_tokens": i + 1,
        "instance_id": "inst",
        "token_ids": [100 + i],
        "logprobs": [-float(i)],
        "tokens": [f"t{i}"],
        "top_logprobs": [[(f"t{i}", -float(i)), ("x", -9.0)]],
    } | kw
    return TokenChunk(**fields)  # type: ignore[arg-type]


def test_merge_concatenates_tokens_and_keeps_the_last_counts_and_finish() -> None:
    parts = [make_chunk(0), make_chunk(1), make_chunk(2, finish_reason="stop", error="")]
    out = merge(parts, seq=4)
    assert out.seq == 4 and out.req_id == "r" and out.instance_id == "inst"
    assert out.text == "t0t1t2"
    assert out.num_tokens == 3
    assert out.token_ids == [100, 101, 102]
    assert out.logprobs == [0.0, -1.0, -2.0]
    assert out.tokens == ["t0", "t1", "t2"]
    assert out.top_logprobs == [[(f"t{i}", -float(i)), ("x", -9.0)] for i in range(3)]
    assert out.num_output_tokens == 3 and out.num_prompt_tokens == 7
    assert out.finish_reason == "stop"


def test_merge_takes_the_error_of_the_last_chunk() -> None:
    out = merge([make_chunk(0), make_chunk(1, finish_reason="error", error="boom")], seq=0)
    assert out.finish_reason == "error" and out.error == "boom" and out.text == "t0t1"


def test_merge_of_one_chunk_only_renumbers_it() -> None:
    one = make_chunk(5, seq=2)
    assert merge([one], seq=2) is one
    assert merge([one], seq=3) == TokenChunk(**{**_fields(one), "seq": 3})


def _fields(c: TokenChunk) -> dict[str, object]:
    return {f: getattr(c, f) for f in c.__struct_fields__}


def test_stream_releases_at_max_tokens_or_max_age_and_numbers_chunks_in_order() -> None:
    cfg = Coalescing(max_tokens=3, max_age_s=0.5)
    s = Stream("tidal.gw.x", seq=5)
    assert not s.is_due(100.0, cfg) and s.take() is None  # nothing held
    s.hold(make_chunk(0), 100.0)
    s.hold(make_chunk(1), 100.1)
    assert not s.is_due(100.2, cfg)
    assert s.is_due(100.5, cfg)  # the oldest is 0.5 s old
    s.hold(make_chunk(2), 100.2)
    assert s.is_due(100.2, cfg)  # three held
    first = s.take()
    assert first is not None and first.seq == 5 and first.token_ids == [100, 101, 102]
    assert s.seq == 6 and not s.held and s.num_held_tokens == 0
    s.hold(make_chunk(3), 101.0)  # the age counts from the oldest still held
    assert not s.is_due(101.4, cfg) and s.is_due(101.5, cfg)
    second = s.take()
    assert second is not None and second.seq == 6 and second.text == "t3"


@pytest.mark.parametrize(("tokens", "age_s", "on"), [(32, 0.25, True), (1, 0.25, False)])
def test_coalescing_is_off_at_one_token_or_zero_age(tokens: int, age_s: float, on: bool) -> None:
    assert Coalescing(tokens, age_s).is_on is on
    assert not Coalescing(0, 0.25).is_on and not Coalescing(32, 0.0).is_on


@pytest.mark.parametrize(("tokens", "age_s"), [(-1, 0.25), (32, -0.1), (32, 3.0)])
def test_coalescing_refuses_bad_settings(tokens: int, age_s: float) -> None:
    with pytest.raises(ValueError, match="offline chunk"):
        Coalescing(tokens, age_s)


def test_tokens_are_never_held_near_the_gateways_silent_stream_check() -> None:
    # the gateway re-runs a stream silent for STALL_S that its instance no longer reports
    assert Coalescing().max_age_s <= MAX_AGE_LIMIT_S <= resync.STALL_S / 5


def test_instance_flags_and_environment_set_coalescing(monkeypatch: pytest.MonkeyPatch) -> None:
    args = instance_main.parse_args(["--offline-chunk-tokens", "8", "--offline-chunk-s", "0.1"])
    assert instance_main.coalescing(args) == Coalescing(8, 0.1)
    assert instance_main.coalescing(instance_main.parse_args([])) == Coalescing()
    monkeypatch.setenv("TIDAL_OFFLINE_CHUNK_TOKENS", "1")
    assert not instance_main.coalescing(instance_main.parse_args([])).is_on
    monkeypatch.setenv("TIDAL_OFFLINE_CHUNK_S", "9")
    with pytest.raises(ValueError, match="offline chunk age"):
        instance_main.coalescing(instance_main.parse_args([]))


def test_instance_exits_with_a_clear_error_on_a_bad_setting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert instance_main.main(["--offline-chunk-tokens", "-2"]) == 2
    assert "offline chunk tokens must be >= 0" in capsys.readouterr().err
