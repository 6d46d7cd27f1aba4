"""`tidal bench burst --client guidellm`: the swing's online load sent by an outside client.

guidellm runs one rate per benchmark, so its rate profiles cannot swing; its trace replay can:
the schedule's online arrivals are written in guidellm's minimal trace format and replayed
(`--profile kind=replay`), as `tidal bench replay --client guidellm` does
(`tidal_bench/replay/guidellm.py`, whose helpers this uses). The Batch API jobs still go through
the official openai client, since guidellm has no Batch API. guidellm starts its replay when its
process is ready, a few seconds after the jobs were submitted; that offset is read from its
output (`scheduler_start_time`) and reported, and the simulator runs the online arrivals shifted
by it, so both sides see the same load. guidellm runs from its own environment (`--guidellm
PATH`); nothing else imports it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tidal.config.cluster import ClusterConfig
from tidal.schemas.enums import RequestClass
from tidal_bench.burst.schedule import BurstSchedule, OnlineResult, outcome_of
from tidal_bench.replay import guidellm as gl


def error_outcome(text: str) -> str:
    """The outcome of a request guidellm reports errored, from its error text: httpx's
    `HTTPStatusError("Client error '429 Too Many Requests' ...")` names the status; anything
    else (a refused connection, a broken stream) is an error without one."""
    m = re.search(r"(?:Client|Server) error '(\d{3})", text)
    return outcome_of(int(m.group(1)) if m else None)


def results_of(
    doc: dict[str, Any], first_arrival_s: float, sentinel_trace_s: float
) -> tuple[list[OnlineResult], float]:
    """guidellm's JSON output -> (each online request as an OnlineResult on the schedule's
    clock, the Unix time of the schedule's 0). The sentinel row is left out."""
    recs, _ = gl.parse_output(doc)
    recs = [r for r in recs if round(r.trace_s, 4) != round(sentinel_trace_s, 4)]
    out = []
    for r in recs:
        ttft = None if r.first_token is None else r.first_token - r.request_start
        itl = None
        if r.first_token is not None and r.last_token is not None and r.output_tokens > 1:
            itl = (r.last_token - r.first_token) / (r.output_tokens - 1)
        out.append(OnlineResult(first_arrival_s + r.trace_s, "ok", ttft, itl))
    reqs = doc["benchmarks"][0]["requests"]
    for r in (reqs.get("errored") or []) + (reqs.get("incomplete") or []):
        info = r.get("info") or {}
        trace_s = float((info.get("settings") or {}).get("relative_timestamp") or 0.0)
        text = str(info.get("error") or r.get("error") or "")
        if round(trace_s, 4) == round(sentinel_trace_s, 4):
            continue
        out.append(OnlineResult(first_arrival_s + trace_s, error_outcome(text)))
    origin = recs[0].origin if recs else float("nan")
    return sorted(out, key=lambda o: o.sent_s), origin - first_arrival_s


def run_online(
    exe: str, base: str, model: str, sched: BurstSchedule, seed: int, cfg: ClusterConfig
) -> tuple[list[OnlineResult], float, str]:
    """Replay the schedule's online arrivals with guidellm against `base` (blocks until it is
    done). Returns the results, the Unix time of the schedule's 0, and the command line."""
    reqs = [r for r in sched.sim_requests(seed, cfg.slo) if r.req_class is RequestClass.ONLINE]
    rows = gl.trace_rows(reqs, "online")
    if not rows:
        raise gl.GuidellmError("the schedule sends no online request for guidellm to replay")
    sentinel = gl.sentinel_row(rows, cfg)
    with tempfile.TemporaryDirectory(prefix="tidal-burst-guidellm-") as tmp_:
        tmp = Path(tmp_)
        tok = gl.write_tokenizer(tmp / "tokenizer")
        gl.write_trace(tmp / "online.jsonl", [*rows, sentinel])
        out = tmp / "online.json"
        cmd = gl.guidellm_command(exe, base, model, tmp / "online.jsonl", tok, out, "online")
        with (tmp / "online.log").open("wb") as log:
            rc = subprocess.run(
                cmd, env={**os.environ, **gl.GUIDELLM_ENV}, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        if rc != 0:
            tail = (tmp / "online.log").read_text(errors="replace")[-2000:]
            raise gl.GuidellmError(f"guidellm exited with {rc}:\n{tail}")
        doc = json.loads(out.read_text())
    first = float(rows[0]["timestamp"])
    results, zero_unix = results_of(doc, first, float(sentinel["timestamp"]) - first)
    return results, zero_unix, " ".join(cmd)
