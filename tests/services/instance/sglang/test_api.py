"""SGLang 0.5.23's HTTP shapes, as `services.instance.sglang.api` reads and writes them."""

from __future__ import annotations

import pytest

from services.instance.sglang.api import (
    PRIORITY,
    generate_body,
    new_rid,
    parse_chunk,
    parse_loads,
    server_args,
)
from tidal.engine.api import FinishReason, SamplingParams
from tidal.schemas.enums import RequestClass


def chunk(ids: list[int], total: int, finish: object = None) -> dict:
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {"completion_tokens": total, "finish_reason": finish},
    }


def test_cumulative_and_incremental_streams_give_the_same_new_tokens() -> None:
    # default: output_ids holds every token so far
    a = parse_chunk(chunk([5], 1), 0)
    b = parse_chunk(chunk([5, 6, 7], 3), a.completion_tokens)
    # --incremental-streaming-output: only this chunk's
    c = parse_chunk(chunk([5], 1), 0)
    d = parse_chunk(chunk([6, 7], 3), c.completion_tokens)
    assert a.token_ids == c.token_ids == (5,)
    assert b.token_ids == d.token_ids == (6, 7)
    assert b.completion_tokens == d.completion_tokens == 3


@pytest.mark.parametrize(
    ("finish", "want"),
    [
        ({"type": "length", "length": 3}, FinishReason.LENGTH),
        ({"type": "stop", "matched": 2}, FinishReason.STOP),
        ({"type": "abort", "message": "queue full"}, FinishReason.ABORT),
        ({"type": "something-new"}, FinishReason.ERROR),
    ],
)
def test_finish_reasons(finish: dict, want: FinishReason) -> None:
    up = parse_chunk(chunk([1, 2, 3], 3, finish), 2)
    assert up.finish is want and up.token_ids == (3,)
    if want is FinishReason.ABORT:
        assert "queue full" in up.error


def test_an_error_chunk_and_a_malformed_one() -> None:
    up = parse_chunk({"error": {"message": "bad input", "code": 400}}, 4)
    assert up.finish is FinishReason.ERROR and "bad input" in up.error
    with pytest.raises(ValueError):
        parse_chunk({"text": "x"}, 0)


def test_logprobs_follow_the_new_tokens() -> None:
    meta = {"completion_tokens": 2, "output_token_logprobs": [[-0.5, 9, None], [-1.5, 10, None]]}
    up = parse_chunk({"output_ids": [9, 10], "meta_info": meta}, 1)
    assert up.token_ids == (10,) and up.logprobs == (-1.5,)


def test_generate_body() -> None:
    sp = SamplingParams(max_tokens=50, temperature=0.5, top_k=0, stop=("END",), stop_token_ids=(7,))
    body = generate_body("tidal-x", [1, 2], sp, 20, RequestClass.OFFLINE, ("10.0.0.1", 8998, 42))
    assert body["priority"] == PRIORITY[RequestClass.OFFLINE]
    assert body["sampling_params"] == {
        "max_new_tokens": 20,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": -1,
        "ignore_eos": False,
        "skip_special_tokens": False,
        "stop_token_ids": [7],
    }  # stop strings are cut by Tidal, not sent
    assert (body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]) == (
        "10.0.0.1",
        8998,
        42,
    )
    with pytest.raises(ValueError):
        generate_body("r", [], sp, 5, RequestClass.ONLINE)
    with pytest.raises(ValueError):
        generate_body("r", [1], sp, 0, RequestClass.ONLINE)


def test_loads_add_up_over_dp_ranks() -> None:
    obj = {
        "loads": [
            {
                "num_running_reqs": 2,
                "num_waiting_reqs": 1,
                "num_used_tokens": 100,
                "max_total_num_tokens": 1000,
                "token_usage": 0.1,
                "gen_throughput": 50.0,
            },
            {
                "num_running_reqs": 3,
                "num_waiting_reqs": 0,
                "num_used_tokens": 300,
                "max_total_num_tokens": 1000,
                "token_usage": 0.3,
                "gen_throughput": 70.0,
            },
        ]
    }
    load = parse_loads(obj)
    assert (load.num_running, load.num_waiting, load.num_used_tokens) == (5, 1, 400)
    assert load.max_total_tokens == 2000 and load.token_usage == 0.3
    assert load.gen_throughput == 120.0
    with pytest.raises(ValueError):
        parse_loads({"num_running_reqs": 1})


def test_server_args_turn_priority_scheduling_on_and_rids_have_one_length() -> None:
    argv = server_args("/m", "127.0.0.1", 30000, ["--tp", "2"])
    assert "--enable-priority-scheduling" in argv and "--enable-metrics" in argv
    assert argv[argv.index("--schedule-policy") + 1] == "fcfs"
    assert argv[-2:] == ["--tp", "2"]
    rids = {new_rid() for _ in range(100)}
    assert len(rids) == 100 and len({len(r) for r in rids}) == 1


def test_the_stop_token_that_ended_a_request_is_named() -> None:
    up = parse_chunk(chunk([4, 2], 2, {"type": "stop", "matched": 2}), 1)
    assert up.finish is FinishReason.STOP and up.stop_token == 2 and up.token_ids == (2,)
    assert parse_chunk(chunk([4], 1, {"type": "stop", "matched": "END"}), 0).stop_token is None
