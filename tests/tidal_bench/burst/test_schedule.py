"""The burst schedule: phases, arrivals at each phase's rate, the simulator's requests, and the
per-phase and per-job bookkeeping."""

from __future__ import annotations

import math

import pytest

from tidal.policy.state import Slo
from tidal.schemas.enums import RequestClass
from tidal_bench.burst.schedule import (
    BurstSchedule,
    OnlineResult,
    job_curve,
    jobs_from_times,
    outcome_of,
    phase_table,
)


def make_schedule(**kw: object) -> BurstSchedule:
    base = dict(
        high_rate=10.0,
        low_rate=1.0,
        phase_s=100.0,
        cycles=2,
        prompt_tokens=32,
        output_tokens=8,
        jobs=2,
        lines=3,
        line_prompt_tokens=64,
        line_output_tokens=16,
    )
    return BurstSchedule(**(base | kw))  # type: ignore[arg-type]


def test_phases_alternate_burst_and_trough_back_to_back() -> None:
    s = make_schedule()
    phases = s.phases()
    assert [p["kind"] for p in phases] == ["burst", "trough", "burst", "trough"]
    assert [p["rate"] for p in phases] == [10.0, 1.0, 10.0, 1.0]
    assert [(p["start_s"], p["end_s"]) for p in phases] == [
        (0.0, 100.0),
        (100.0, 200.0),
        (200.0, 300.0),
        (300.0, 400.0),
    ]
    assert s.duration_s == 400.0
    assert [s.phase_of(t) for t in (0.0, 99.9, 100.0, 399.0, 450.0)] == [0, 0, 1, 3, 3]
    with pytest.raises(ValueError, match="before the run"):
        s.phase_of(-1.0)


def test_arrivals_follow_each_phases_rate_and_repeat_with_the_seed() -> None:
    s = make_schedule()
    a = s.arrivals(seed=3)
    assert a == s.arrivals(seed=3) and a != s.arrivals(seed=4)
    assert a == sorted(a) and a[0] >= 0.0 and a[-1] < 400.0
    per_phase = [sum(1 for t in a if s.phase_of(t) == i) for i in range(4)]
    # Poisson counts: 1000 expected per burst (sd ~32), 100 per trough (sd 10)
    assert all(900 < n < 1100 for n in per_phase[::2])
    assert all(65 < n < 135 for n in per_phase[1::2])


def test_a_silent_trough_sends_nothing() -> None:
    s = make_schedule(low_rate=0.0)
    assert all(s.phase_of(t) % 2 == 0 for t in s.arrivals(seed=0))


def test_the_simulators_requests_are_the_arrivals_and_every_line_in_time_order() -> None:
    s = make_schedule(high_rate=0.5, low_rate=0.1)
    slo = Slo(ttft_s=2.0, tpot_s=0.05)
    reqs = s.sim_requests(seed=1, slo=slo)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    online = [r for r in reqs if r.req_class is RequestClass.ONLINE]
    offline = [r for r in reqs if r.req_class is RequestClass.OFFLINE]
    assert [r.arrival_s for r in online] == s.arrivals(seed=1)
    assert all((r.input_tokens, r.output_tokens, r.slo) == (32, 8, slo) for r in online)
    assert sorted(r.req_id for r in offline) == sorted(
        ["job0-0", "job0-1", "job0-2", "job1-0", "job1-1", "job1-2"]
    )
    assert all((r.arrival_s, r.input_tokens, r.output_tokens) == (0.0, 64, 16) for r in offline)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"high_rate": 0.0}, "burst rate must be > 0"),
        ({"low_rate": -1.0}, "trough rate >= 0"),
        ({"low_rate": 20.0}, "swap --high-rate and --low-rate"),
        ({"phase_s": 0.0}, "--phase-s must be > 0"),
        ({"cycles": 0}, "--cycles >= 1"),
        ({"output_tokens": 0}, "output_tokens must be >= 1"),
        ({"lines": 0}, "--lines >= 1"),
    ],
)
def test_bad_schedules_are_refused_with_the_option_to_fix(
    change: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_schedule(**change)


def test_statuses_become_outcomes() -> None:
    assert [outcome_of(c) for c in (200, 429, 500, 503, 400, None)] == [
        "ok",
        "429",
        "5xx",
        "5xx",
        "error",
        "error",
    ]


def test_the_phase_table_puts_each_request_in_the_phase_it_was_sent_in() -> None:
    s = make_schedule()
    results = [
        OnlineResult(1.0, "ok", ttft_s=0.010, itl_s=0.002),
        OnlineResult(2.0, "ok", ttft_s=0.030, itl_s=0.004),
        OnlineResult(3.0, "429"),
        OnlineResult(150.0, "ok", ttft_s=0.5, itl_s=None),  # one token: no gap
        OnlineResult(160.0, "5xx"),
        OnlineResult(170.0, "error"),
    ]
    rows = phase_table(s, results)
    assert [r["num_sent"] for r in rows] == [3, 3, 0, 0]
    burst, trough, empty = rows[0], rows[1], rows[2]
    assert (burst["num_ok"], burst["num_429"], burst["num_5xx"]) == (2, 1, 0)
    assert burst["ttft_p50_ms"] == pytest.approx(20.0)  # median of 10 and 30 ms
    assert burst["ttft_p99_ms"] == pytest.approx(29.8)  # 10 + 0.99 * 20
    assert burst["itl_p50_ms"] == pytest.approx(3.0)
    assert (trough["num_ok"], trough["num_5xx"], trough["num_error"]) == (1, 1, 1)
    assert trough["ttft_p50_ms"] == pytest.approx(500.0)
    assert math.isnan(trough["itl_p50_ms"])  # no request with two tokens
    assert empty["kind"] == "burst" and math.isnan(empty["ttft_p99_ms"])


def test_a_jobs_curve_and_completion_come_from_its_lines_times() -> None:
    assert job_curve(0.5, [3.0, 1.0, 2.0]) == [(0.5, 0), (1.0, 1), (2.0, 2), (3.0, 3)]
    s = make_schedule()
    jobs = jobs_from_times(s, 0.0, {"job0-0": 4.0, "job0-1": 9.0, "job0-2": 6.0, "job1-0": 2.0})
    assert [j["status"] for j in jobs] == ["completed", "incomplete"]
    assert jobs[0]["completed_s"] == 9.0 and jobs[1]["completed_s"] is None
    assert [j["num_results"] for j in jobs] == [3, 1]
    assert jobs[1]["curve"] == [(0.0, 0), (2.0, 1)]
