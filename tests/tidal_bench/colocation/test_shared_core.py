"""The shared-core contention benchmark's arithmetic: c = together / alone / 2 per worker and
alternation, a together step counted only inside the other worker's stepping, alone windows on
both sides of each together window averaged."""

from __future__ import annotations

import pytest

from tidal_bench.colocation.shared_core import Window, contention, pooled


def _steps(start: float, ms: list[float], cpu: float = 0.0) -> Window:
    out, t = [], start
    for m in ms:
        out.append((t, t + m / 1e3, cpu or m / 1e3))
        t += m / 1e3
    return Window(out)


def test_c_is_together_over_the_surrounding_alone_windows_halved() -> None:
    # alone 100 ms then 110 ms (a decode's context grew): mean 105; together 231 ms -> c 1.1
    alone = [
        [_steps(0.0, [100.0] * 5), _steps(1.0, [50.0] * 5)],
        [_steps(10.0, [110.0] * 5), _steps(11.0, [50.0] * 5)],
    ]
    together = [[_steps(5.0, [231.0] * 5), _steps(5.0, [100.0] * 12)]]
    got = contention(alone, together)
    assert got["c_per_alternation_A"] == [1.1]
    assert got["c_per_alternation_B"] == [1.0]
    assert got["c_median"] == pytest.approx(1.05)
    assert got["c_min_max"] == [1.0, 1.1]
    assert pooled({"k": got, "j": got}) == pytest.approx(1.05)


def test_a_together_step_outside_the_others_stepping_is_not_counted() -> None:
    alone = [[_steps(0.0, [100.0] * 3)] * 2, [_steps(9.0, [100.0] * 3)] * 2]
    # A's last four steps ran after B stopped (alone again, 100 ms): they do not count
    a = Window(_steps(5.0, [200.0] * 3).steps + _steps(5.6, [100.0] * 4).steps)
    b = _steps(5.0, [200.0] * 3)
    got = contention(alone, [[a, b]])
    assert got["c_per_alternation_A"] == [1.0] and got["c_per_alternation_B"] == [1.0]
    assert a.median_wall() == pytest.approx(0.1)  # all seven: the steps past B's end
    assert a.median_wall(*b.span) == pytest.approx(0.2)
    assert len([s for s in a.steps if s[0] >= b.span[0] and s[1] <= b.span[1]]) == 3
