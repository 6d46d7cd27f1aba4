"""A migration target that cannot be reached is backed off, exponentially and capped: a few
attempts a minute toward a lost host, never hundreds a second."""

from __future__ import annotations

import pytest

from tidal.cluster.backoff import TargetBackoff


def test_each_failure_doubles_the_wait_up_to_the_cap_and_a_success_clears_it() -> None:
    b = TargetBackoff(base_s=0.5, max_s=4.0)
    waits = [b.failed("inst-1", 10.0) - 10.0 for _ in range(6)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.is_backed_off("inst-1", 13.9) and not b.is_backed_off("inst-1", 14.0)
    assert not b.is_backed_off("inst-2", 10.0) and b.retry_at("inst-2") == 0.0
    b.succeeded("inst-1")
    assert not b.is_backed_off("inst-1", 10.0)
    assert b.failed("inst-1", 20.0) == 20.5  # the doubling starts again
    assert b.num_backoffs == 7


def test_a_lost_target_gets_a_handful_of_attempts_a_minute() -> None:
    # Every 10 ms something wants to migrate toward a host that is gone (as the scheduler's
    # 0.2 s placement retries of many requests would); only attempts past the back-off go out.
    b = TargetBackoff()  # 0.5 s doubling to 30 s
    attempts = 0
    for step in range(6000):  # 60 s
        now = step * 0.01
        if not b.is_backed_off("gone", now):
            attempts += 1
            b.failed("gone", now)
    # 0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5 (then every 30 s): 7 attempts in the minute.
    assert attempts == 7


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="base_s"):
        TargetBackoff(base_s=0.0)
    with pytest.raises(ValueError, match="max_s"):
        TargetBackoff(base_s=5.0, max_s=1.0)
