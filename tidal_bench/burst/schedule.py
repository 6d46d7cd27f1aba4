"""The burst/trough schedule and the per-phase bookkeeping of `tidal bench burst` (pure: no I/O,
no clock; times are seconds from the start of the run).

The online load swings between a high and a low rate, `phase_s` seconds each, `cycles` times
(burst, trough, burst, trough, ...), as llm-d's batch-gateway benchmark design (llm-d #491)
proposes; `jobs` Batch API jobs of `lines` lines each are submitted at the start.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tidal.policy.state import Slo
from tidal.schemas.enums import RequestClass
from tidal.workload.mix import SimRequest
from tidal_bench.kit import pct

BURST, TROUGH = "burst", "trough"


@dataclass(frozen=True)
class BurstSchedule:
    """The online swing and the offline jobs."""

    high_rate: float  # online req/s in a burst
    low_rate: float  # online req/s in a trough
    phase_s: float  # length of each burst and each trough, seconds
    cycles: int  # burst + trough pairs
    prompt_tokens: int  # online prompt length, tokens
    output_tokens: int  # online output length, tokens
    jobs: int  # Batch API jobs submitted at the start
    lines: int  # lines per job
    line_prompt_tokens: int  # each line's prompt length, tokens
    line_output_tokens: int  # each line's output length, tokens

    def __post_init__(self) -> None:
        if not self.high_rate > 0 or self.low_rate < 0:
            raise ValueError(
                f"the burst rate must be > 0 and the trough rate >= 0 (req/s), got "
                f"{self.high_rate} and {self.low_rate}"
            )
        if self.low_rate > self.high_rate:
            raise ValueError(
                f"the trough rate ({self.low_rate}/s) is above the burst rate "
                f"({self.high_rate}/s): swap --high-rate and --low-rate"
            )
        if not self.phase_s > 0 or self.cycles < 1:
            raise ValueError(
                f"--phase-s must be > 0 and --cycles >= 1, got {self.phase_s} and {self.cycles}"
            )
        for name in ("prompt_tokens", "output_tokens", "line_prompt_tokens", "line_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 token, got {getattr(self, name)}")
        if self.jobs < 0 or self.lines < 1:
            raise ValueError(f"--jobs must be >= 0 and --lines >= 1, got {self.jobs}/{self.lines}")

    @property
    def duration_s(self) -> float:
        return 2 * self.cycles * self.phase_s

    def phases(self) -> list[dict[str, float | str | int]]:
        """Each phase in order: index, kind (burst|trough), start_s, end_s, rate (req/s)."""
        out: list[dict[str, float | str | int]] = []
        for i in range(2 * self.cycles):
            kind = BURST if i % 2 == 0 else TROUGH
            rate = self.high_rate if kind == BURST else self.low_rate
            start = i * self.phase_s
            out.append(
                {
                    "index": i,
                    "kind": kind,
                    "start_s": start,
                    "end_s": start + self.phase_s,
                    "rate": rate,
                }
            )
        return out

    def phase_of(self, t_s: float) -> int:
        """The index of the phase that time `t_s` falls in (the last one past the end)."""
        if t_s < 0:
            raise ValueError(f"time {t_s} s is before the run started")
        return min(int(t_s // self.phase_s), 2 * self.cycles - 1)

    def arrivals(self, seed: int) -> list[float]:
        """Online arrival times: a Poisson process at each phase's rate (a trough at 0/s sends
        nothing). Same seed, same arrivals, so the live run and the simulator see one load."""
        rng = random.Random(seed)
        out: list[float] = []
        for ph in self.phases():
            rate, t, end = float(ph["rate"]), float(ph["start_s"]), float(ph["end_s"])
            if rate <= 0:
                continue
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                out.append(t)
        return out

    def line_ids(self) -> list[list[str]]:
        """Per job, its lines' custom_ids (`job<j>-<i>`; the simulator's req_ids too)."""
        return [[f"job{j}-{i}" for i in range(self.lines)] for j in range(self.jobs)]

    def sim_requests(self, seed: int, slo: Slo, online_offset_s: float = 0.0) -> list[SimRequest]:
        """The whole run as the simulator's requests: the online arrivals (with `slo`, moved
        `online_offset_s` later) and every job's lines arriving at 0 (the simulator's batch gate
        holds them, as the batch service does live), in arrival order."""
        out = [
            SimRequest(
                f"on{i}",
                RequestClass.ONLINE,
                t + online_offset_s,
                self.prompt_tokens,
                self.output_tokens,
                slo,
            )
            for i, t in enumerate(self.arrivals(seed))
        ]
        for ids in self.line_ids():
            out += [
                SimRequest(
                    rid, RequestClass.OFFLINE, 0.0, self.line_prompt_tokens, self.line_output_tokens
                )
                for rid in ids
            ]
        return sorted(out, key=lambda r: r.arrival_s)  # the simulator takes them in time order


@dataclass(frozen=True)
class OnlineResult:
    """One online request as either side saw it."""

    sent_s: float  # when it was sent (live) or arrived (simulated)
    outcome: str  # ok | 429 | 5xx | error (connection or other status)
    ttft_s: float | None = None  # first token, from sent_s
    itl_s: float | None = None  # mean gap between its tokens ((last - first) / (n - 1))


OUTCOMES = ("ok", "429", "5xx", "error")


def outcome_of(status: int | None) -> str:
    """An HTTP status (None: no response at all) as an OnlineResult outcome."""
    if status is None:
        return "error"
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    return "ok" if status < 400 else "error"


def phase_table(sched: BurstSchedule, results: list[OnlineResult]) -> list[dict[str, Any]]:
    """Per phase: its kind and rate, online requests sent in it, TTFT and ITL p50/p99 (ms, of
    the requests that got a first token / finished), and its 429, 5xx and other error counts."""
    rows = []
    for ph in sched.phases():
        mine = [r for r in results if sched.phase_of(r.sent_s) == ph["index"]]
        ttft = [r.ttft_s for r in mine if r.ttft_s is not None]
        itl = [r.itl_s for r in mine if r.itl_s is not None]
        counts = {o: sum(1 for r in mine if r.outcome == o) for o in OUTCOMES}
        rows.append(
            {
                **ph,
                "num_sent": len(mine),
                "num_ok": counts["ok"],
                "num_429": counts["429"],
                "num_5xx": counts["5xx"],
                "num_error": counts["error"],
                "ttft_p50_ms": 1e3 * pct(ttft, 50),
                "ttft_p99_ms": 1e3 * pct(ttft, 99),
                "itl_p50_ms": 1e3 * pct(itl, 50),
                "itl_p99_ms": 1e3 * pct(itl, 99),
            }
        )
    return rows


def job_curve(created_s: float, done_s: list[float]) -> list[tuple[float, int]]:
    """A job's completed-lines curve from its lines' completion times: (t, lines done by t),
    starting at (created_s, 0), one point per completion, in time order."""
    pts = [(created_s, 0)]
    for n, t in enumerate(sorted(done_s), start=1):
        pts.append((t, n))
    return pts


def jobs_from_times(
    sched: BurstSchedule, created_s: float, done: dict[str, float]
) -> list[dict[str, Any]]:
    """Jobs described from per-line completion times (`custom_id -> s`), as the simulator
    knows them; a job is complete when every one of its lines has a time."""
    out = []
    for j, ids in enumerate(sched.line_ids()):
        times = [done[i] for i in ids if i in done]
        complete = len(times) == len(ids)
        out.append(
            {
                "job": j,
                "status": "completed" if complete else "incomplete",
                "lines": len(ids),
                "created_s": created_s,
                "completed_s": max(times) if complete and times else None,
                "num_results": len(times),
                "num_failed": 0,
                "curve": job_curve(created_s, times),
            }
        )
    return out
