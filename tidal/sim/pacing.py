"""The fewest steps an online load's SLO pace forces: interval multi-cover by points.

Point 7 of `tidal.sim.limit`'s docstring. An online request r that meets its SLO produces its
O_r tokens in O_r distinct steps (the prefill's last chunk gives the first token, each decode
step one more; a request is in one step at a time, and each step starts after the one before
it ends), all ending inside [arrival_r, deadline_r], deadline_r = arrival_r + TTFT_r +
(O_r - 1) TPOT_r. Steps may be shared between requests and run on any instance, so the steps of
all instances together end at no fewer distinct times than the fewest points of the line such
that every request's interval holds at least O_r of them.

The greedy below finds that fewest (`min_points`): take the intervals by right end; count the
points already placed inside; place the missing ones as far right as they go, at the right end
and just before it (points are distinct reals, so a cluster b, b - e, b - 2e, ... for an e
smaller than any gap between the endpoints). Optimal by the usual exchange argument: every
interval taken later ends at or after b, so a point at b - ie lies in each later interval that
any other point of [a, b] lies in (each starting before b), and moving a solution's points
rightward to the greedy's positions never uncovers a later interval. A zero-width interval
holds one distinct point at most; its demand is taken as min(O, 1) (a relaxation: never more
than any schedule needs). The tests check the greedy against exhaustive search.

A schedule may fail `forgiven` requests (the violation cap), and failing a request can only
lower the fewest points; `forgiven_points` bounds what is left from below, the larger of two
valid floors: (a) the fewest points for all, less the `forgiven` largest demands (a request
removed lowers the fewest by at most its demand); (b) chains: a set of pairwise disjoint
intervals needs the sum of their demands, each its own points. Take the heaviest such set
(weighted interval scheduling), take its requests out, repeat: request-disjoint chains C_j of
weight w_j. Failing k requests of C_j leaves it at least w_j less its k largest demands, and k
failures touch at most k chains, so whichever requests fail, some chain keeps at least the
(forgiven + 1)-th largest of the values {w_j - (its k largest demands) : k = 0 .. |C_j| - 1},
over all chains. On one trace's requests (many overlap at once) (b) keeps most of the fewest,
where (a) is 0: a hundred forgiven requests' demands exceed it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Iterable, Sequence

import numpy as np


def _demand(lo: float, hi: float, demand: int) -> int:
    """What an interval can hold: a zero-width one one distinct point at most (module docstring)."""
    return min(demand, 1) if hi == lo else demand


def min_points(intervals: Iterable[tuple[float, float, int]]) -> int:
    """The fewest distinct points such that each closed interval (lo, hi, demand) holds at
    least `demand` of them (zero-width intervals: at most 1). O(n log n)."""
    rows = []
    for lo, hi, demand in intervals:
        if hi < lo:
            raise ValueError(f"interval ends before it starts: [{lo}, {hi}]")
        if demand < 0:
            raise ValueError(f"demand must be >= 0, got {demand}")
        rows.append((hi, lo, _demand(lo, hi, demand)))
    rows.sort()
    pos: list[float] = []  # cluster positions, ascending: points at b, b - e, b - 2e, ...
    cum: list[int] = []  # points in clusters 0..i
    total = 0
    for hi, lo, demand in rows:
        j = bisect_right(pos, lo)
        have = total - (cum[j - 1] if j else 0)  # clusters right of lo: all their points
        if j and pos[j - 1] == lo:
            have += 1  # the cluster at lo: only its point exactly at lo
        missing = demand - have
        if missing <= 0:
            continue
        total += missing
        if pos and pos[-1] == hi:
            cum[-1] = total
        else:
            pos.append(hi)
            cum.append(total)
    return total


def _heaviest_disjoint(lo: np.ndarray, hi: np.ndarray, demand: np.ndarray) -> list[int]:
    """Indices of a heaviest set of pairwise disjoint closed intervals (`hi` ascending)."""
    prev = np.searchsorted(hi, lo, side="left")  # intervals ending strictly before each start
    best = [0] * (len(lo) + 1)
    for i in range(len(lo)):
        with_i = best[prev[i]] + int(demand[i])
        best[i + 1] = with_i if with_i > best[i] else best[i]
    out, i = [], len(lo)
    while i > 0:
        if best[i] != best[i - 1]:
            out.append(i - 1)
            i = int(prev[i - 1])
        else:
            i -= 1
    return out


def forgiven_points(intervals: Sequence[tuple[float, float, int]], forgiven: int) -> int:
    """A lower bound on the fewest points (`min_points`) left once any `forgiven` intervals are
    dropped: the larger of the module docstring's floors (a) and (b); exact when none is."""
    if forgiven < 0:
        raise ValueError(f"forgiven must be >= 0, got {forgiven}")
    full = min_points(intervals)
    if forgiven == 0 or full == 0:
        return full
    demands = sorted((d for _, _, d in intervals), reverse=True)
    floor_a = max(full - sum(demands[:forgiven]), 0)
    rows = sorted((hi, lo, _demand(lo, hi, d)) for lo, hi, d in intervals if d > 0)
    hi = np.array([r[0] for r in rows], dtype=float)
    lo = np.array([r[1] for r in rows], dtype=float)
    dem = np.array([r[2] for r in rows], dtype=np.int64)
    top: list[int] = []  # the forgiven + 1 largest values left of any chain (a min-heap)
    while len(lo):
        chain = _heaviest_disjoint(lo, hi, dem)
        d = sorted((int(dem[i]) for i in chain), reverse=True)
        w = sum(d)
        if len(top) > forgiven and w <= top[0]:
            break  # chains only get lighter: none can raise the (forgiven + 1)-th value
        for k in range(len(d)):
            if len(top) <= forgiven:
                heapq.heappush(top, w)
            elif w > top[0]:
                heapq.heapreplace(top, w)
            else:
                break
            w -= d[k]
        keep = np.ones(len(lo), dtype=bool)
        keep[chain] = False
        lo, hi, dem = lo[keep], hi[keep], dem[keep]
    floor_b = top[0] if len(top) > forgiven else 0
    return max(floor_a, floor_b)
