"""The live max-offline search on fake measurements: which loads it probes and what it answers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tidal_bench.colocation.max_offline import Measurement, Point, is_saturated, search_max_offline


def make_measure(
    attain: Callable[[float], list[float]], done_ratio: float = 1.0
) -> tuple[Callable[[float], list[Measurement]], list[float]]:
    """A fake stack: at `qps`, one measurement per attainment in `attain(qps)`; offline lines
    complete at `done_ratio` x the offered rate, 100 tokens each."""
    asked: list[float] = []

    def measure(qps: float) -> list[Measurement]:
        asked.append(qps)
        return [
            Measurement(a, 100 * qps * done_ratio, qps * done_ratio, num_online=20)
            for a in attain(qps)
        ]

    return measure, asked


def test_grows_then_bisects_to_the_largest_load_that_keeps_the_target() -> None:
    # attainment falls below 97 % past 5 QPS
    measure, asked = make_measure(lambda q: [99.0, 98.0, 100.0] if q <= 5 else [90.0, 99.0, 80.0])
    out = search_max_offline(measure, 97.0, start=1.0, max_load=64.0, iters=2)
    # 0 (online alone), 1, 2, 4, 8 (fails), bisect: 6 (fails), 5 (holds)
    assert asked == [0.0, 1.0, 2.0, 4.0, 8.0, 6.0, 5.0]
    assert out.best.load_qps == 5.0
    assert out.max_offline_tokens_per_s == 500.0
    assert not out.saturated
    assert [p.load_qps for p in out.probes] == asked


def test_the_repeats_requests_together_decide_and_median_and_spread_are_kept() -> None:
    # 20 requests a window: 20 + 20 + 19 attained of 60 = 98.3 % holds; 20 + 19 + 18 = 95 % not
    measure, _ = make_measure(lambda q: [100.0, 100.0, 95.0] if q < 3 else [100.0, 95.0, 90.0])
    out = search_max_offline(measure, 97.0, start=1.0, max_load=64.0, iters=0)
    assert out.best.load_qps == 2.0
    assert out.best.attainment_pct == pytest.approx(100 * 59 / 60)
    assert out.best.attainment_median_pct == 100.0
    assert out.best.spread("attainment_pct") == (95.0, 100.0)
    assert out.probes[-1].attainment_pct == pytest.approx(95.0)


def test_online_alone_missing_the_target_answers_zero() -> None:
    measure, asked = make_measure(lambda q: [90.0, 91.0, 92.0])
    out = search_max_offline(measure, 97.0, start=1.0, max_load=8.0, iters=3)
    assert asked == [0.0]
    assert out.best.load_qps == 0.0 and out.max_offline_tokens_per_s == 0.0


def test_stops_growing_once_offline_completions_fall_behind_the_offered_load() -> None:
    measure, asked = make_measure(lambda q: [100.0] * 3, done_ratio=0.5)
    out = search_max_offline(measure, 97.0, start=1.0, max_load=64.0, iters=3)
    assert asked == [0.0, 1.0]
    assert out.saturated and out.max_offline_tokens_per_s == 50.0


def test_a_load_that_never_fails_stops_at_the_cap() -> None:
    measure, asked = make_measure(lambda q: [100.0] * 3)
    out = search_max_offline(measure, 97.0, start=1.0, max_load=4.0, iters=3)
    assert asked == [0.0, 1.0, 2.0, 4.0]
    assert out.best.load_qps == 4.0 and not out.saturated


def test_saturation_ignores_the_zero_load_point() -> None:
    assert not is_saturated(Point(0.0, (Measurement(100.0, 0.0, 0.0),)))
    assert is_saturated(Point(2.0, (Measurement(100.0, 10.0, 1.0),)))


def test_bad_bounds_and_empty_points_are_refused() -> None:
    measure, _ = make_measure(lambda q: [100.0])
    with pytest.raises(ValueError, match="start"):
        search_max_offline(measure, 97.0, start=0.0, max_load=4.0, iters=1)
    with pytest.raises(ValueError, match="iters"):
        search_max_offline(measure, 97.0, start=1.0, max_load=4.0, iters=-1)
    with pytest.raises(ValueError, match="no measurement"):
        Point(1.0, ())


def test_the_cap_is_probed_itself_when_doubling_steps_over_it() -> None:
    measure, asked = make_measure(lambda q: [100.0] * 3)
    out = search_max_offline(measure, 97.0, start=4.0, max_load=20.0, iters=1)
    assert asked == [0.0, 4.0, 8.0, 16.0, 20.0]
    assert out.bound == "cap" and out.describe() == "held at the cap 20"


def test_what_ended_the_search_is_reported() -> None:
    measure, _ = make_measure(lambda q: [100.0] * 3, done_ratio=0.5)
    assert search_max_offline(measure, 97.0, 1.0, 64.0, 1).describe() == "saturated at 1"
    measure, _ = make_measure(lambda q: [100.0] if q <= 5 else [50.0])
    out = search_max_offline(measure, 97.0, start=1.0, max_load=64.0, iters=2)
    assert out.bound == "slo" and out.failed_at == 6.0
    assert out.describe() == "SLO-bound at 5 (fails at 6)"
    measure, _ = make_measure(lambda q: [50.0])
    out = search_max_offline(measure, 97.0, start=1.0, max_load=64.0, iters=2)
    assert out.bound == "online-alone" and out.failed_at == 0.0
