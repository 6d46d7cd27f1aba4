"""`tidal bench burst`'s report: one side (live or simulated) of one policy as figures, the
printed table per policy and phase, a markdown table for docs, and the plot."""

from __future__ import annotations

import math
from typing import Any

from tidal_bench.burst.schedule import BurstSchedule, OnlineResult, phase_table

# what produced each side's figures, printed with them
LABELS = {
    "live": "live stack, sim engine (emulated step times)",
    "simulated": "simulator (simulated)",
}


def side_report(sched: BurstSchedule, side: str, raw: dict[str, Any]) -> dict[str, Any]:
    """One side of one policy: its label, the phase table, the jobs, and whether every line of
    every job has a result (`all_lines_done`) and how many lines have none (`num_lines_lost`)."""
    online: list[OnlineResult] = raw["online"]
    jobs = raw["jobs"]
    lost = sum(j["lines"] - j["num_results"] - j["num_failed"] for j in jobs)
    done = [j["completed_s"] for j in jobs]
    return {
        "label": LABELS[side],
        "phases": phase_table(sched, online),
        "jobs": jobs,
        "all_lines_done": len(jobs) == sched.jobs
        and all(j["num_results"] == j["lines"] for j in jobs),
        "num_lines_lost": lost,
        "last_job_completed_s": None if not done or None in done else max(done),
        "online_offset_s": raw.get("online_offset_s", 0.0),
    } | ({"guidellm_command": raw["guidellm_command"]} if "guidellm_command" in raw else {})


def _f(x: float | None, nd: int = 0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def print_policy(policy: str, sides: dict[str, dict[str, Any]]) -> None:
    """Per phase, each side's online figures; then each job's completion per side."""
    print(f"  {policy}")
    print(
        "    side       phase       rate/s  sent  TTFT p50  TTFT p99  ITL p50  ITL p99  "
        "429  5xx  err"
    )
    for side, rep in sides.items():
        for row in rep["phases"]:
            name = f"{row['index']} {row['kind']}"
            print(
                f"    {side:9s}  {name:10s} {row['rate']:6.1f} {row['num_sent']:5d}  "
                f"{_f(row['ttft_p50_ms']):>6s}ms {_f(row['ttft_p99_ms']):>7s}ms "
                f"{_f(row['itl_p50_ms'], 1):>6s}ms {_f(row['itl_p99_ms'], 1):>6s}ms "
                f"{row['num_429']:4d} {row['num_5xx']:4d} {row['num_error']:4d}"
            )
    for side, rep in sides.items():
        jobs = ", ".join(
            f"job {j['job']}: {j['num_results']}/{j['lines']} lines, "
            f"{'done at ' + _f(j['completed_s'], 1) + ' s' if j['completed_s'] else j['status']}"
            for j in rep["jobs"]
        )
        lost = rep["num_lines_lost"]
        print(f"    {side:9s}  jobs: {jobs or 'none'}; lines without a result: {lost}")


def markdown(report: dict[str, Any]) -> str:
    """One table for docs: per policy, side and phase the online figures, and each side's
    job completion times."""
    lines = [
        "| policy | side | phase | rate/s | sent | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
        "429 | 5xx | jobs done at (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, sides in report["runs"].items():
        for side, rep in sides.items():
            jobs = " / ".join(_f(j["completed_s"], 0) for j in rep["jobs"])
            for k, row in enumerate(rep["phases"]):
                lines.append(
                    f"| {policy} | {side} | {row['index']} {row['kind']} | {row['rate']:g} | "
                    f"{row['num_sent']} | {_f(row['ttft_p50_ms'])} / {_f(row['ttft_p99_ms'])} | "
                    f"{_f(row['itl_p50_ms'], 1)} / {_f(row['itl_p99_ms'], 1)} | "
                    f"{row['num_429']} | {row['num_5xx']} | {jobs if k == 0 else ''} |"
                )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Per policy (a column): the offered online rate per phase with each side's TTFT p99 per
    phase above, and each job's completed-lines curve below (live solid, simulated dashed), all
    on the jobs' clock (an online schedule that started late, guidellm's, is drawn late)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    phases = next(iter(next(iter(runs.values())).values()))["phases"]
    fig, axes = plt.subplots(2, len(runs), figsize=(5 * len(runs), 7), squeeze=False, sharex="col")
    styles = {"live": "-", "simulated": "--"}
    for col, (policy, sides) in enumerate(runs.items()):
        top, bottom = axes[0][col], axes[1][col]
        # on the jobs' clock: the online schedule started `online_offset_s` after them
        off = float(next(iter(sides.values())).get("online_offset_s", 0.0))
        xs = [off + p["start_s"] for p in phases] + [off + phases[-1]["end_s"]]
        rates = [p["rate"] for p in phases] + [phases[-1]["rate"]]
        top.step(xs, rates, where="post", color="0.6", label="online rate (offered)")
        top.set_ylabel("online req/s")
        ttft = top.twinx()
        for side, rep in sides.items():
            mids = [off + (p["start_s"] + p["end_s"]) / 2 for p in rep["phases"]]
            ttft.plot(
                mids,
                [p["ttft_p99_ms"] for p in rep["phases"]],
                styles[side],
                marker="o",
                color="C3",
                label=f"TTFT p99, {side}",
            )
            for j in rep["jobs"]:
                ts, ns = zip(*j["curve"], strict=True) if j["curve"] else ((), ())
                bottom.step(
                    ts,
                    ns,
                    styles[side],
                    where="post",
                    color=f"C{j['job']}",
                    label=f"job {j['job']}, {side}",
                )
        ttft.set_ylabel("TTFT p99 (ms)")
        what = {"live": "solid: live, sim engine (emulated)", "simulated": "dashed: simulated"}
        top.set_title(f"{policy}\n" + "; ".join(what[s] for s in sides), fontsize=9)
        top.legend(loc="upper left", fontsize=7)
        ttft.legend(loc="upper right", fontsize=7)
        for p in phases:
            if p["kind"] == "burst":
                bottom.axvspan(off + p["start_s"], off + p["end_s"], color="0.92")
        bottom.set_xlabel("seconds from the jobs' submission (shaded: bursts)")
        bottom.set_ylabel("job lines completed")
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
