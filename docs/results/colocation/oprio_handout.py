"""Where a live `online-priority` hand-out's time goes, from one run's traces
(`TIDAL_SIM_STEP_TRACE_DIR`: the sim engine's `instance-*.jsonl`, the scheduler's
`scheduler.ndjson`); docs/colocation.md, "online-priority: the hand-out".

    python docs/results/colocation/oprio_handout.py TRACE_DIR [--last-s 10] [--json OUT]

The window is the last `--last-s` seconds before the last dispatch (the last measured window of
a `tidal bench colocation` run). The relaxed (prefill) instance is `instance-0`. A hand-out is a
held line dispatched while that instance had ended its last step: from that step's end to the
line joining the engine (`add`) the instance waits for it: `SimConfig.handout_ms` models this.
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


def analyse(d: Path, last_s: float) -> dict:
    relaxed = read(d / "instance-0.jsonl")
    sched = read(d / "scheduler.ndjson")
    disp = [e for e in sched if e["event"] == "dispatch"]
    t1 = disp[-1]["unix_s"]
    t0 = t1 - last_s
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
        "window_s": last_s,
        "relaxed_busy_fraction": round(busy, 4),
        "relaxed_steps": len(steps),
        "dispatches": sum(t0 <= e["unix_s"] <= t1 for e in disp),
        "handout_ms": ms(handout),  # step end -> the next line joins (the instance waits)
        "first_token_to_report_ms": ms(to_report),  # prefill's first token -> its report in
        "dispatch_tick_to_add_ms": ms(tick_to_add),  # reply, Batch API submit, instance loop
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--last-s", type=float, default=10.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = analyse(args.trace_dir, args.last_s)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
