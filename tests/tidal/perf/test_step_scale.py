"""Measured over predicted step time (`tidal.perf.step_scale`)."""

from __future__ import annotations

import pytest

from tidal.perf.step_scale import MAX_RATIO, StepTimeScale


def test_no_steps_and_faster_steps_leave_the_model_as_it_is() -> None:
    s = StepTimeScale()
    assert s.value == 1.0
    for _ in range(10):
        s.observe(0.1, 0.08)  # faster than predicted: never loosens a budget
    assert s.value == 1.0


def test_the_long_steps_weigh_most() -> None:
    s = StepTimeScale(window=8)
    for _ in range(4):
        s.observe(0.2, 0.44)  # two engines on one core: 2.2x
        s.observe(0.02, 0.019)  # a short step alone: 0.95x
    assert s.value == pytest.approx((4 * 0.44 + 4 * 0.019) / (4 * 0.22))


def test_the_window_forgets_what_changed() -> None:
    s = StepTimeScale(window=4)
    for _ in range(4):
        s.observe(0.1, 0.2)
    assert s.value == pytest.approx(2.0)
    for _ in range(4):  # the other engine went idle: its steps are the model's again
        s.observe(0.1, 0.1)
    assert s.value == pytest.approx(1.0)


def test_tiny_predictions_and_stalls_are_bounded() -> None:
    s = StepTimeScale(window=4)
    s.observe(1e-5, 1.0)  # predicted next to nothing: not counted
    assert s.value == 1.0
    s.observe(0.1, 60.0)  # a minute's stall counts as MAX_RATIO, not 600x
    assert s.value == pytest.approx(MAX_RATIO)
    with pytest.raises(ValueError, match="window"):
        StepTimeScale(window=0)
