"""`tidal bench replay`'s serving path as the window itself had it: the probe measures it on an
idle stack, but on this 2-core host the window's own load (the client's streams, the gateway, the
decode loop) slows the parts the CPU does, the KV data plane most (lone 234 MB pushes: 0.8-0.95
GB/s in the window against 1.1-2.7 GB/s in the probe).

Two figures, each read from the window's own records, none from the compared figures:

- **dispatch** (client sent -> the request joined an engine, plus first token made -> client
  had it): per online request from the client's and the sim engine's clocks, only for requests
  that reached an instance between its steps (a request that waited for a step to end waited in
  a queue the simulator has too), fitted `a + b x prompt tokens` like the probe's;
- **KV link rate**: bytes over data-plane seconds (the scheduler's migration events) of the
  window's transfers that overlapped no other transfer (a shared link's rate is a share), fitted
  like the probe's hand-off; the fixed part stays the probe's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tidal_bench.replay.probe import by_length, fit_line

QUEUED_GAP_S = 0.003  # joined an engine this soon after its step ended: it waited for that step
MIN_POINTS = 3  # fewer usable requests or transfers than this: keep the probe's figure


def read_trace(trace_dir: Path) -> tuple[dict[str, list[float]], dict[str, tuple[str, float]]]:
    """(instance -> its steps' end times, sorted; req_id -> (instance, unix_s) of its `add`)."""
    ends: dict[str, list[float]] = {}
    adds: dict[str, tuple[str, float]] = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "emulated_s" in rec:
                ends.setdefault(path.stem, []).append(rec["unix_s"])
            elif rec.get("event") == "add" and rec["req_id"] not in adds:
                adds[rec["req_id"]] = (path.stem, rec["unix_s"])
    return {k: sorted(v) for k, v in ends.items()}, adds


def unqueued_paths(
    requests: list[dict[str, Any]],
    ends: dict[str, list[float]],
    adds: dict[str, tuple[str, float]],
) -> list[tuple[int, float]]:
    """(prompt tokens, client sent -> joined an engine, seconds) of the window's online requests
    that joined between steps (no step of that instance ended within QUEUED_GAP_S before)."""
    out = []
    for r in requests:
        rid = r.get("req_id") or ""
        got = adds.get(rid) or adds.get(rid.split("-", 1)[-1])
        if r["class"] != "online" or got is None or "sent_unix_s" not in r:
            continue
        inst, t_add = got
        steps = ends.get(inst, [])
        k = int(np.searchsorted(steps, t_add, side="right"))
        if k and t_add - steps[k - 1] < QUEUED_GAP_S:
            continue  # it waited for the step that just ended
        out.append((int(r["input_tokens"]), t_add - r["sent_unix_s"]))
    return out


def window_dispatch(
    paths: list[tuple[int, float]], out_ms_p50: float
) -> tuple[float, float] | None:
    """(ms, us per token) of the window's dispatch: the unqueued paths in, fitted by length
    (medians per length), plus the window's median first token -> client; None if too few."""
    if len(paths) < MIN_POINTS:
        return None
    n, v = by_length([p[0] for p in paths], [p[1] for p in paths])
    a_s, b_s = fit_line(n, v)
    return 1e3 * a_s + out_ms_p50, 1e6 * b_s


def lone_transfers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The successful transfers no other transfer overlapped in time."""
    ok = [r for r in rows if r["outcome"] == "ok" and r["num_bytes"] > 0 and r["transfer_s"] > 0]
    return [
        r
        for r in ok
        if not any(
            o is not r
            and o["start_unix_s"] < r["end_unix_s"]
            and o["end_unix_s"] > r["start_unix_s"]
            for o in ok
        )
    ]


def window_link_gb_per_s(rows: list[dict[str, Any]], cap_gb_per_s: float) -> float | None:
    """The KV link's rate in the window (GB/s): 1 / the slope of data-plane seconds over bytes
    of its lone transfers (at most `cap_gb_per_s`, the configured link); None if too few."""
    lone = lone_transfers(rows)
    if len({r["num_bytes"] for r in lone}) < MIN_POINTS:
        return None
    _, s_per_byte = fit_line([r["num_bytes"] for r in lone], [r["transfer_s"] for r in lone])
    if s_per_byte <= 0:
        return cap_gb_per_s
    return min(cap_gb_per_s, 1 / s_per_byte / 1e9)


def window_calibration(
    cal: dict[str, Any],
    live: dict[str, Any],
    trace: tuple[dict[str, list[float]], dict[str, tuple[str, float]]],
    cap_gb_per_s: float,
) -> dict[str, Any]:
    """The probe's calibration `cal` with the window's dispatch and KV link rate where the
    window had enough of them (`window_dispatch`, `window_link`: whether each was replaced);
    `trace` is the window's `read_trace`."""
    ends, adds = trace
    out = {k: v for k, v in cal.items() if k != "probe"}
    path = live.get("path") or {}
    out_ms = (path.get("out_ms_p50_p90_p99") or [0.0])[0]
    disp = window_dispatch(unqueued_paths(live["requests"], ends, adds), out_ms)
    if disp is not None:
        out["dispatch_ms"], out["dispatch_us_per_token"] = disp
    rate = window_link_gb_per_s(live.get("migration_events") or [], cap_gb_per_s)
    if rate is not None:
        out["link_gb_per_s"] = rate
    out["window_dispatch"] = disp is not None
    out["window_link"] = rate is not None
    return out
