"""`tidal bench replay --client guidellm`: trace export and output parsing (no guidellm needed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tidal.config.cluster import load_config
from tidal.schemas.enums import RequestClass
from tidal.workload.mix import SimRequest
from tidal_bench.replay import guidellm as gl

ON, OFF = RequestClass.ONLINE, RequestClass.OFFLINE


def _reqs() -> list[SimRequest]:
    return [
        SimRequest("off-0", OFF, 0.0, 600, 100),
        SimRequest("on-1", ON, 1.25, 300, 10),
        SimRequest("on-0", ON, 0.5, 200, 4),
        SimRequest("off-1", OFF, 2.0, 50, 3),
    ]


def _cfg() -> Any:
    cfg = load_config("configs/ooco.yaml")  # slo: ttft 2 s, tpot 0.05 s
    return dataclasses.replace(cfg, duration_s=10.0)


def test_trace_rows_one_class_in_order_and_written_as_json_lines(tmp_path: Path) -> None:
    rows = gl.trace_rows(_reqs(), "online")
    assert rows == [
        {"timestamp": 0.5, "input_length": 200, "output_length": 4},
        {"timestamp": 1.25, "input_length": 300, "output_length": 10},
    ]
    gl.write_trace(tmp_path / "t.jsonl", rows)
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == rows


def test_sentinel_arrives_after_every_row_should_be_done() -> None:
    rows = gl.trace_rows(_reqs(), "offline")
    s = gl.sentinel_row(rows, _cfg())
    # off-0: 0 + 2 + 100 * 0.05 = 7; off-1: 2 + 2 + 3 * 0.05 = 4.15 -> 7 + 1
    assert s == {"timestamp": 8.0, "input_length": 1, "output_length": 1}


def test_command_names_the_replay_profile_the_trace_and_the_class(tmp_path: Path) -> None:
    cmd = gl.guidellm_command(
        "/x/guidellm", "http://h:1/v1", "tidal-sim", tmp_path / "t.jsonl", tmp_path / "tok",
        tmp_path / "o.json", "offline",
    )  # fmt: skip
    assert cmd[:2] == ["/x/guidellm", "run"]
    opts = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert opts["--profile"] == "kind=replay,schedule_turn=timestamp"
    backend = json.loads(opts["--backend"])
    assert backend["extras"] == {"body": {"request_class": "offline"}}
    assert backend["request_format"] == "/v1/completions"
    data = json.loads(opts["--data"])
    assert data["kind"] == "trace_synthetic"
    assert data["source"] == {"kind": "json_file", "path": str(tmp_path / "t.jsonl")}
    assert opts["--tokenizer"] == f"kind=hf_auto,model={tmp_path / 'tok'}"


def test_find_guidellm_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(gl.GuidellmError, match="--guidellm"):
        gl.find_guidellm(str(tmp_path / "nope"))


def _request(
    rel: float, origin: float, start: float, first: float, last: float, n: int, max_tokens: int
) -> dict[str, Any]:
    """One successful request as guidellm 0.8.1 writes it (only the fields read)."""
    return {
        "request_args": json.dumps({"body": {"max_tokens": max_tokens, "prompt": "x"}}),
        "info": {
            "scheduler_start_time": origin,
            "settings": {"relative_timestamp": rel},
            "timings": {
                "targeted_start": origin + rel,
                "request_start": start,
                "first_token_iteration": first,
                "last_token_iteration": last,
            },
        },
        "input_metrics": {"text_tokens": 200},
        "output_metrics": {"text_tokens": n},
    }


def _doc(successful: list[dict[str, Any]], errored: int = 0) -> dict[str, Any]:
    reqs = {"successful": successful, "errored": [{}] * errored, "incomplete": []}
    return {"benchmarks": [{"requests": reqs}]}


def test_parse_and_figures() -> None:
    cfg = _cfg()
    rows = {c: gl.trace_rows(_reqs(), c) for c in gl.CLASSES}
    t = 1000.0  # online process origin; its first row is at trace 0.5 -> trace time 0 = 999.5
    online = _doc(
        [
            # trace 0.5: sent 10 ms late, TTFT 0.1 s, 4 tokens over 0.09 s -> TPOT 0.03: attained
            _request(0.0, t, t + 0.01, t + 0.11, t + 0.20, 4, 4),
            # trace 1.25: TTFT 0.05 s, TPOT 0.1 s: missed
            _request(0.75, t, t + 0.75, t + 0.80, t + 1.70, 10, 10),
        ],
        errored=1,
    )
    on_recs, on_failed = gl.parse_output(online)
    assert on_failed == 1 and len(on_recs) == 2
    assert on_recs[0].max_tokens == 4 and on_recs[0].output_tokens == 4
    # offline process started 0.3 s after the online one (trace 0 at 999.8); off-1 not reported
    o = 999.8
    off_recs, _ = gl.parse_output(_doc([_request(0.0, o, o, o + 1.0, o + 10.9, 100, 100)]))
    fig = gl.figures(
        rows, {"online": on_recs, "offline": off_recs}, {"online": 1, "offline": 0}, cfg
    )
    assert fig["num_online"] == 3  # the errored one counts as missed
    assert fig["slo_attainment_pct"] == pytest.approx(100 / 3)
    assert fig["ttft_p50_s"] == pytest.approx(0.075)
    assert fig["start_offset_s"] == {"online": 0.0, "offline": pytest.approx(0.3)}
    assert fig["unrecorded"] == {"online": 0, "offline": 1}
    assert fig["prompt_tokens_mismatched"] == 1  # trace 1.25 asked 300, the server counted 200
    # window: 999.5 + 10 = 1009.5; offline tokens at 1000.8 + i * 0.1 -> i <= 87 -> 88 tokens
    assert fig["offline_tokens_per_s"] == pytest.approx(88 / 10)
    assert fig["dispatch_lag_p50_s"] == pytest.approx(0.005)


def test_tokens_in_window_edges() -> None:
    r = gl.Record(0, 0, 0, 0, first_token=1.0, last_token=2.0, max_tokens=11, input_tokens=None,
                  output_tokens=11)  # fmt: skip
    assert gl.tokens_in_window(r, 5.0) == 11
    assert gl.tokens_in_window(r, 0.5) == 0
    assert gl.tokens_in_window(r, 1.0) == 1
    assert gl.tokens_in_window(r, 1.55) == 6


def test_shifted_moves_one_class_and_keeps_arrival_order() -> None:
    moved = gl.shifted(_reqs(), {"offline": 1.0})
    assert [(r.req_id, r.arrival_s) for r in moved] == [
        ("on-0", 0.5),
        ("off-0", 1.0),
        ("on-1", 1.25),
        ("off-1", 3.0),
    ]
