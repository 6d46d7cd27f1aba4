"""The live max-offline search's logic, apart from the stack it measures (pure: no I/O, no clock).

OOCO §5.2, as `tidal.sim.search.max_offline` runs it in the simulator: raise the uniform offline
QPS from zero; the largest load at which online SLO attainment stays >= the target is the
policy's maximum effective offline throughput. Live, every point is measured `repeats` times
(a live run is not deterministic) and judged on the median; the spread (min, max) is kept.
The load grows geometrically from `start` until a point fails (or stops completing what it is
offered, or reaches `max_load`, which is probed itself when the doubling steps over it), then
`iters` bisection steps narrow it down: few points, so a
search over three policies fits in minutes.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Measurement:
    """One measured window (warm-up already discarded)."""

    attainment_pct: float  # online requests within both SLOs / online requests, %
    offline_tokens_per_s: float  # offline output tokens completed per second in the window
    offline_lines_per_s: float  # offline lines (requests) completed per second in the window
    num_online: int = 0  # online requests counted
    ttft_p99_s: float = float("nan")  # online TTFT p99
    tpot_p99_s: float = float("nan")  # online TPOT p99
    # CPU over the measured part: each stack process's and the load generator's CPU s/s, and
    # each core's busy share (`tidal_bench.kit.CpuClock`); None when not measured
    cpu: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Point:
    """All repeats at one offline load, and their median and spread."""

    load_qps: float  # offline lines offered per second (uniform)
    runs: tuple[Measurement, ...]

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError(f"no measurement at offline load {self.load_qps}")

    def _med(self, key: str) -> float:
        return float(statistics.median(getattr(m, key) for m in self.runs))

    def spread(self, key: str) -> tuple[float, float]:
        """(min, max) of field `key` over the repeats."""
        values = [float(getattr(m, key)) for m in self.runs]
        return min(values), max(values)

    @property
    def attainment_pct(self) -> float:
        """Online attainment over every repeat's requests together: the figure a point is
        judged on (one window of a few dozen requests moves by whole requests' worth)."""
        n = sum(m.num_online for m in self.runs)
        if n == 0:
            return self._med("attainment_pct")
        return sum(m.attainment_pct * m.num_online for m in self.runs) / n

    @property
    def attainment_median_pct(self) -> float:
        """The median of the repeats' attainments (their spread: `spread("attainment_pct")`)."""
        return self._med("attainment_pct")

    @property
    def offline_tokens_per_s(self) -> float:
        return self._med("offline_tokens_per_s")

    @property
    def offline_lines_per_s(self) -> float:
        return self._med("offline_lines_per_s")


@dataclass
class Outcome:
    """A policy's search: every point probed, and the answer."""

    best: Point  # the largest load that kept the target (the zero-load point if none did)
    probes: list[Point] = field(default_factory=list)  # in the order measured
    saturated: bool = False  # offline completions stopped following the offered load
    failed_at: float | None = None  # the lowest load found to miss the target, if any

    @property
    def bound(self) -> str:
        """What ended the search: "saturated" (offline completions fell behind the offered load
        while the SLO held), "slo" (a larger load missed the SLO), "online-alone" (the zero-load
        point missed it) or "cap" (every load up to the largest allowed held)."""
        if self.saturated:
            return "saturated"
        if self.failed_at is None:
            return "cap"
        return "online-alone" if self.failed_at == 0.0 else "slo"

    def describe(self) -> str:
        """ "saturated at X", "SLO-bound at X (fails at Y)", ... for the printed table."""
        x, bound = f"{self.best.load_qps:g}", self.bound
        if bound == "saturated":
            return f"saturated at {x}"
        if bound == "slo":
            return f"SLO-bound at {x} (fails at {self.failed_at:g})"
        if bound == "online-alone":
            return "online alone misses the SLO"
        return f"held at the cap {x}"

    @property
    def max_offline_tokens_per_s(self) -> float:
        """Offline tokens/s completed at the best point (0 if only online alone held)."""
        return self.best.offline_tokens_per_s if self.best.load_qps > 0 else 0.0


def is_saturated(p: Point, ratio: float = 0.8) -> bool:
    """Offline lines completed fall short of `ratio` x those offered: more load only grows the
    backlog (the simulator's test, `tidal.sim.search.max_offline`)."""
    return p.load_qps > 0 and p.offline_lines_per_s < ratio * p.load_qps


def search_max_offline(
    measure: Callable[[float], Sequence[Measurement]],
    target_pct: float,
    start: float,
    max_load: float,
    iters: int,
) -> Outcome:
    """The largest offline QPS in {0} U [start, max_load] at which the online attainment of
    `measure(qps)`'s repeats (their requests pooled) stays >= `target_pct`. Grows by 2x from
    `start` (the last step clipped to `max_load`), then bisects `iters` times between the last
    good and the first bad load."""
    if not 0 < start <= max_load:
        raise ValueError(f"need 0 < start ({start}) <= max_load ({max_load})")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    probes: list[Point] = []

    def probe(x: float) -> Point:
        p = Point(x, tuple(measure(x)))
        probes.append(p)
        return p

    def ok(p: Point) -> bool:
        return p.attainment_pct >= target_pct

    base = probe(0.0)
    best = base
    if not ok(base):  # online alone misses the target: no offline load is acceptable
        return Outcome(base, probes, failed_at=0.0)
    bad: float | None = None
    x = start
    while True:
        p = probe(x)
        if not ok(p):
            bad = x
            break
        best = p
        if is_saturated(p):
            return Outcome(best, probes, saturated=True)
        if x >= max_load:
            break
        x = min(2 * x, max_load)
    if bad is None:
        return Outcome(best, probes)
    for _ in range(iters):
        mid = (best.load_qps + bad) / 2
        p = probe(mid)
        if ok(p):
            best = p
            if is_saturated(p):
                return Outcome(best, probes, saturated=True, failed_at=bad)
        else:
            bad = mid
    return Outcome(best, probes, failed_at=bad)


def point_row(p: Point) -> dict[str, Any]:
    return {
        "offline_qps": p.load_qps,
        "attainment_pct": p.attainment_pct,
        "attainment_median_pct": p.attainment_median_pct,
        "attainment_spread": p.spread("attainment_pct"),
        "offline_tokens_per_s": p.offline_tokens_per_s,
        "offline_tokens_per_s_spread": p.spread("offline_tokens_per_s"),
        "offline_lines_per_s": p.offline_lines_per_s,
        "cpu": point_cpu(p),
        "runs": [dataclasses.asdict(m) for m in p.runs],
    }


def point_cpu(p: Point) -> dict[str, Any] | None:
    """The median over a point's windows of each process's CPU s/s, of their sum and of each
    core's busy share; None where no window measured CPU (the simulator's)."""
    rows = [m.cpu for m in p.runs if m.cpu]
    if not rows:
        return None

    def med(values: list[float]) -> float:
        return round(float(np.median(values)), 3)

    names = sorted({n for r in rows for n in r["cpu_s_per_s"]})
    cores = sorted({c for r in rows for c in r["core_busy"]})
    return {
        "cpu_s_per_s": {n: med([r["cpu_s_per_s"].get(n, 0.0) for r in rows]) for n in names},
        "stack_and_loadgen_cpu_s_per_s": med([r["stack_and_loadgen_cpu_s_per_s"] for r in rows]),
        "core_busy": {c: med([r["core_busy"].get(c, 0.0) for r in rows]) for c in cores},
        "loadavg_1m": med([r.get("loadavg_1m", float("nan")) for r in rows]),
    }
