"""Where a live `online-priority` hand-out's time goes, from one run's traces
(`TIDAL_SIM_STEP_TRACE_DIR`: the sim engine's `instance-*.jsonl`, the scheduler's
`scheduler.ndjson`); docs/colocation.md, "online-priority: the hand-out".

    python docs/results/colocation/oprio_handout.py TRACE_DIR [--warmup-s 4 --measure-s 10]
        [--json OUT]

Each window of offline load starts with its first dispatch (the first line arrives at once;
windows are apart by their settling, seconds with no dispatch); its measured part is
[start + warm-up, start + warm-up + measure], as `tidal bench colocation` counts it. The relaxed
(prefill) instance is `instance-0`. A hand-out is a held line dispatched after that instance
had ended its last step: from that step's end to the line joining the engine (`add`) the
instance waits for it; `ClusterConfig.handout_ms` models this.
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path

import numpy as np


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def ms(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e3
    if not len(a):
        return {"n": 0}
    p50, p90 = np.percentile(a, [50, 90])
    return {"n": len(a), "p50": round(p50, 2), "mean": round(a.mean(), 2), "p90": round(p90, 2)}


GAP_S = 2.0  # dispatches this far apart belong to different windows


def windows(disp: list[dict], warmup_s: float, measure_s: float) -> list[tuple[float, float]]:
    starts = [
        e["unix_s"]
        for i, e in enumerate(disp)
        if i == 0 or e["unix_s"] - disp[i - 1]["unix_s"] > GAP_S
    ]
    return [(t + warmup_s, t + warmup_s + measure_s) for t in starts]


def analyse(d: Path, warmup_s: float, measure_s: float) -> dict:
    sched = read(d / "scheduler.ndjson")
    disp = [e for e in sched if e["event"] == "dispatch"]
    per = [window(d, sched, disp, t0, t1) for t0, t1 in windows(disp, warmup_s, measure_s)]
    pooled = {
        k: ms([x for w in per for x in w.pop("_" + k)])
        for k in ("handout", "to_report", "tick_to_add")
    }
    return {
        "windows": per,
        "relaxed_busy_fraction": [w["relaxed_busy_fraction"] for w in per],
        "handout_ms": pooled["handout"],  # step end -> the next line joins (the instance waits)
        "first_token_to_report_ms": pooled["to_report"],  # prefill's first token -> its report
        "dispatch_tick_to_add_ms": pooled["tick_to_add"],  # reply, Batch API submit, loop
    }


def window(d: Path, sched: list[dict], disp: list[dict], t0: float, t1: float) -> dict:
    relaxed = read(d / "instance-0.jsonl")
    last_s = t1 - t0
    steps = [e for e in relaxed if "emulated_s" in e and t0 <= e["unix_s"] <= t1]
    add = {e["req_id"]: e["unix_s"] for e in relaxed if e.get("event") == "add"}
    first = sorted(e["unix_s"] for e in relaxed if e.get("event") == "first")
    reports = sorted(e["unix_s"] for e in sched if e["event"] == "report" and e["index"] == 0)
    ends = sorted(s["unix_s"] for s in steps)
    busy = sum(s["wall_s"] for s in steps) / last_s
    handout, to_report, tick_to_add = [], [], []
    for e in disp:
        if not t0 <= e["unix_s"] <= t1 or e["req_id"] not in add:
            continue
        a = add[e["req_id"]]
        i = bisect.bisect_right(ends, a) - 1
        if i >= 0 and e["tick_unix_s"] >= ends[i]:  # the instance had ended its step: it waited
            handout.append(a - ends[i])
            tick_to_add.append(a - e["tick_unix_s"])
    for f in first:
        if t0 <= f <= t1 and (j := bisect.bisect_left(reports, f)) < len(reports):
            to_report.append(reports[j] - f)
    return {
        "from_unix_s": round(t0, 3),
        "relaxed_busy_fraction": round(busy, 4),
        "relaxed_steps": len(steps),
        "dispatches": sum(t0 <= e["unix_s"] <= t1 for e in disp),
        "handout_ms": ms(handout),
        "_handout": handout,
        "_to_report": to_report,
        "_tick_to_add": tick_to_add,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--measure-s", type=float, default=10.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = analyse(args.trace_dir, args.warmup_s, args.measure_s)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
