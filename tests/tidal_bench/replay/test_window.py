"""`tidal bench replay`'s serving path read from the window itself: which requests count (those
that joined an engine between its steps), the fits, the lone transfers' link rate, and the
calibration that keeps the probe's figures where the window has too few."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tidal_bench.replay import window as wnd


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _request(rid: str, tokens: int, sent: float) -> dict[str, Any]:
    return {"class": "online", "req_id": f"cmpl-{rid}", "input_tokens": tokens, "sent_unix_s": sent}


def _transfer(start: float, end: float, nbytes: int, wire_s: float) -> dict[str, Any]:
    return {
        "outcome": "ok",
        "num_bytes": nbytes,
        "transfer_s": wire_s,
        "start_unix_s": start,
        "end_unix_s": end,
    }


def test_read_trace_and_unqueued_paths(tmp_path: Path) -> None:
    step = {"emulated_s": 0.1, "host_s": 0.0, "wall_s": 0.1, "late_s": 0.0}
    _write(
        tmp_path / "instance-0.jsonl",
        [
            dict(step, unix_s=10.0),  # a step ending at 10.0
            {"event": "add", "req_id": "a", "unix_s": 10.001},  # joined as it ended: queued
            {"event": "add", "req_id": "b", "unix_s": 20.0},  # an idle instance: not queued
            {"event": "add", "req_id": "b", "unix_s": 25.0},  # (again, elsewhere: the first)
        ],
    )
    ends, adds = wnd.read_trace(tmp_path)
    assert ends == {"instance-0": [10.0]}
    assert adds["b"] == ("instance-0", 20.0)
    reqs = [_request("a", 100, 9.9), _request("b", 200, 19.99), _request("c", 50, 1.0)]
    reqs.append(dict(_request("b", 200, 19.99), **{"class": "offline"}))
    assert wnd.unqueued_paths(reqs, ends, adds) == [(200, pytest.approx(0.01))]


def test_window_dispatch_fits_by_length_plus_the_way_out() -> None:
    # 8 ms + 2 us/token in, medians per length; + 3 ms first token -> client
    paths = [(100, 0.0082), (100, 0.0082), (100, 0.5), (1000, 0.010), (2000, 0.012)]
    ms, us = wnd.window_dispatch(paths, out_ms_p50=3.0)  # type: ignore[misc]
    assert ms == pytest.approx(8.0 + 3.0) and us == pytest.approx(2.0)
    assert wnd.window_dispatch(paths[:2], 3.0) is None  # too few to say


def test_link_rate_from_lone_transfers_only() -> None:
    rows = [
        _transfer(0.0, 0.2, 10**8, 0.11),  # 1 GB/s after 10 ms
        _transfer(1.0, 1.3, 2 * 10**8, 0.21),
        _transfer(2.0, 2.5, 4 * 10**8, 0.41),
        _transfer(3.0, 4.0, 4 * 10**8, 0.9),  # overlaps the next: a shared rate, left out
        _transfer(3.5, 3.6, 10**6, 0.05),
        dict(_transfer(5.0, 5.1, 10**7, 0.01), outcome="refused"),
    ]
    assert len(wnd.lone_transfers(rows)) == 3
    assert wnd.window_link_gb_per_s(rows, cap_gb_per_s=25.0) == pytest.approx(1.0)
    assert wnd.window_link_gb_per_s(rows, cap_gb_per_s=0.5) == 0.5  # never above the link's
    assert wnd.window_link_gb_per_s(rows[:2], 25.0) is None


def test_window_calibration_replaces_what_the_window_measured() -> None:
    cal = {
        "dispatch_ms": 7.0,
        "dispatch_us_per_token": 1.0,
        "link_latency_ms": 12.0,
        "link_gb_per_s": 2.0,
        "handoff_delay_ms": 5.0,
        "probe": [],
    }
    rows = [
        _transfer(0.0, 0.2, 10**8, 0.11),
        _transfer(1.0, 1.3, 2 * 10**8, 0.21),
        _transfer(2.0, 2.5, 4 * 10**8, 0.41),
    ]
    live = {"requests": [], "path": {"out_ms_p50_p90_p99": [2.0]}, "migration_events": rows}
    got = wnd.window_calibration(cal, live, ({}, {}), 25.0)
    assert got["link_gb_per_s"] == pytest.approx(1.0) and got["window_link"]
    assert not got["window_dispatch"] and got["dispatch_ms"] == 7.0  # no request: the probe's
    assert got["link_latency_ms"] == 12.0 and got["handoff_delay_ms"] == 5.0
    assert "probe" not in got
