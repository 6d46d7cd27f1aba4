from __future__ import annotations

import itertools
import random

import pytest

from tidal.sim.pacing import forgiven_points, min_points


def _covers(points: tuple[float, ...], rows: list[tuple[int, int, int]]) -> bool:
    return all(sum(lo <= p <= hi for p in points) >= d for lo, hi, d in rows)


def _brute(rows: list[tuple[int, int, int]]) -> int:
    """Exhaustive: integer endpoints, so some optimal set of distinct points sits at right
    ends e and just below them, e - i/100 (shift each point right to the nearest right end at
    or after it; those that meet there spread below it, past no integer left end)."""
    most = max((d for _, _, d in rows), default=0)
    cands = sorted({hi - i / 100 for _, hi, _ in rows for i in range(most)})
    for k in range(len(cands) + 1):
        if any(_covers(c, rows) for c in itertools.combinations(cands, k)):
            return k
    raise AssertionError("no cover")


def test_greedy_matches_exhaustive_search_on_small_random_sets() -> None:
    rng = random.Random(0)
    for _ in range(250):
        rows = []
        for _ in range(rng.randint(1, 4)):
            lo = rng.randint(0, 5)
            hi = lo + rng.randint(0, 3)
            rows.append((lo, hi, rng.randint(0, 3) if hi > lo else rng.randint(0, 1)))
        assert min_points(rows) == _brute(rows), rows


def test_hand_cases() -> None:
    assert min_points([]) == 0
    assert min_points([(0, 10, 4)]) == 4
    # nested and overlapping intervals share points; disjoint ones cannot
    assert min_points([(0, 10, 4), (5, 10, 4), (9, 12, 2)]) == 4
    assert min_points([(0, 1, 3), (2, 3, 3)]) == 6
    # touching at one point: only the point exactly at 1 is shared
    assert min_points([(0, 1, 2), (1, 2, 2)]) == 3
    # a zero-width interval holds one distinct point at most
    assert min_points([(1, 1, 5)]) == 1
    assert min_points([(0, 1, 3), (1, 1, 1)]) == 3


def test_forgiven_floor_never_passes_the_worst_choice_of_failures() -> None:
    # Whichever `forgiven` intervals a schedule drops, at least the floor is left; with none
    # dropped it is the fewest itself.
    rng = random.Random(2)
    for _ in range(150):
        rows = []
        for _ in range(rng.randint(1, 6)):
            lo = rng.uniform(0, 10)
            rows.append((lo, lo + rng.uniform(0.5, 4), rng.randint(1, 6)))
        assert forgiven_points(rows, 0) == min_points(rows)
        for f in range(1, 3):
            worst = min(
                min_points([r for i, r in enumerate(rows) if i not in drop])
                for k in range(f + 1)
                for drop in itertools.combinations(range(len(rows)), k)
            )
            floor = forgiven_points(rows, f)
            assert floor <= worst, (rows, f, floor, worst)
            # never below the simple floor: all, less the f largest demands
            top = sum(sorted((d for _, _, d in rows), reverse=True)[:f])
            assert floor >= min_points(rows) - top


def test_chains_keep_most_of_an_overlapping_load_that_forgiveness_by_demand_empties() -> None:
    # Ten slots [i, i + 0.9], four requests in each, each needing 10 steps: the fewest is 100
    # (the four of a slot share its points). Forgiving by demand leaves 100 - 10 * 10 = 0. The
    # chains are four request-disjoint rows of 100 ({100, 90, ..., 10} after 0..9 failures):
    # the 11th largest of those 40 values is 80, and that is exact: dropping 10 requests
    # empties at most two slots.
    rows = [(float(i), i + 0.9, 10) for i in range(10) for _ in range(4)]
    assert min_points(rows) == 100
    assert forgiven_points(rows, 10) == 80
    assert forgiven_points(rows, 40) == 0


def test_bad_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        min_points([(2, 1, 1)])
    with pytest.raises(ValueError, match="demand"):
        min_points([(0, 1, -1)])
    with pytest.raises(ValueError, match="forgiven"):
        forgiven_points([(0, 1, 1)], -1)
