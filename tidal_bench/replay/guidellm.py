"""`tidal bench replay --client guidellm`: the replay window's load sent by an outside client.

The same trace window that `tidal bench replay` replays (the config's workload cut to
`--duration-s`) is written in guidellm's minimal trace format (JSON lines: `timestamp`,
`input_length`, `output_length`) and replayed by guidellm (`--profile kind=replay,
schedule_turn=timestamp`, `--data kind=trace_synthetic`) against the same live stack (sim engine
on the simulator's latency model). guidellm makes each prompt from Faker text cut to the row's
token count in an HF tokenizer: the embedded SmolLM2's, written from its GGUF into a temporary
directory (nothing is downloaded; `HF_HUB_OFFLINE=1`).

guidellm sends one request body to every row of a run, so it cannot mix classes: the online and
the offline rows are two guidellm processes started together, each with its class in the body
(`request_class`). Their replays start when each process is ready, so the two timelines are a
little apart; that offset is read from the outputs (`scheduler_start_time`) and the simulator runs
the window with the offline arrivals shifted by it, so both sides see the same load.

From guidellm's JSON output (per request: trace timestamp, request start, first and last token
time, output tokens) the same figures as the in-house client's are computed: online SLO
attainment, TTFT (from the moment guidellm sent the request) and TPOT p50/p99, and offline output
tokens per second inside the window (tokens assumed evenly spaced between a request's first and
last token, since guidellm keeps no per-token times). Each trace ends with a 1-token sentinel row
that arrives after the window's requests should be done (see `sentinel_row`): guidellm 0.8.1 at
times leaves the request that finishes last out of its report. guidellm is optional: nothing else
in Tidal imports it, it runs from its own environment (`--guidellm PATH`, default: `guidellm` on
PATH).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tidal.config.cluster import ClusterConfig
from tidal.workload.mix import SimRequest
from tidal_bench.kit import pct

CLASSES = ("online", "offline")


class GuidellmError(RuntimeError):
    """guidellm is missing or failed; the message says which, in one line (plus its log tail)."""


def find_guidellm(path: str = "") -> str:
    """The guidellm executable: `path` if given, else `guidellm` on PATH."""
    exe = path or shutil.which("guidellm") or ""
    if not exe or not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        raise GuidellmError(
            f"guidellm not found ({path or 'no `guidellm` on PATH'}): install it in its own "
            "environment (pip install guidellm) and pass --guidellm /path/to/bin/guidellm"
        )
    return exe


def trace_rows(reqs: Iterable[SimRequest], req_class: str) -> list[dict[str, Any]]:
    """The rows of one class in guidellm's minimal trace format, in arrival order."""
    return [
        {
            "timestamp": round(r.arrival_s, 6),
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
        }
        for r in sorted(reqs, key=lambda r: r.arrival_s)
        if str(r.req_class) == req_class
    ]


def write_trace(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def sentinel_row(rows: list[dict[str, Any]], cfg: ClusterConfig) -> dict[str, Any]:
    """A 1-token request after every row should have finished (arrival + TTFT SLO + output x TPOT
    SLO, + 1 s). guidellm 0.8.1 sometimes leaves the request that completes last out of its report
    (the benchmark closes while it is still streaming); this row is that last one, and is not
    counted. A real row that finishes later still can be left out: `unrecorded` counts those."""
    end = max(r["timestamp"] + cfg.slo.ttft_s + r["output_length"] * cfg.slo.tpot_s for r in rows)
    return {"timestamp": round(end + 1.0, 6), "input_length": 1, "output_length": 1}


def write_tokenizer(directory: Path) -> Path:
    """An HF-loadable tokenizer directory (`tokenizer.json` + config) of the embedded SmolLM2,
    the tokenizer the sim engine counts prompt tokens with."""
    from tidal.engine.tokenizer import embedded_model_path, load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    load_tokenizer(embedded_model_path()).save(directory)
    return directory


def guidellm_command(
    exe: str, base: str, model: str, trace: Path, tokenizer: Path, out: Path, req_class: str
) -> list[str]:
    backend = {
        "kind": "openai_http",
        "target": base,
        "model": model,
        "request_format": "/v1/completions",
        "extras": {"body": {"request_class": req_class}},
    }
    data = {"kind": "trace_synthetic", "source": {"kind": "json_file", "path": str(trace)}}
    return [
        exe,
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        "kind=replay,schedule_turn=timestamp",
        "--data",
        json.dumps(data),
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console",
    ]


# One worker process per guidellm (its default is up to 10): the stack and both clients share
# this machine's cores. No hub access: the tokenizer is a local directory.
GUIDELLM_ENV = {
    "GUIDELLM__MAX_WORKER_PROCESSES": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclasses.dataclass(frozen=True)
class Record:
    """One request as guidellm recorded it; times are Unix seconds."""

    trace_s: float  # the row's timestamp relative to the first row of its trace file
    origin: float  # the replay's start (`scheduler_start_time`): trace time 0 of the file
    targeted_start: float
    request_start: float
    first_token: float | None
    last_token: float | None
    max_tokens: int
    input_tokens: int | None
    output_tokens: int


def parse_output(doc: dict[str, Any]) -> tuple[list[Record], int]:
    """guidellm's JSON output -> (successful requests, number errored or incomplete)."""
    bench = doc["benchmarks"][0]
    reqs = bench["requests"]
    failed = len(reqs.get("errored") or []) + len(reqs.get("incomplete") or [])
    out = []
    for r in reqs.get("successful") or []:
        info, timings = r["info"], r["info"]["timings"]
        body = json.loads(r["request_args"]).get("body") or {}
        out.append(
            Record(
                trace_s=float(info["settings"]["relative_timestamp"]),
                origin=float(info["scheduler_start_time"]),
                targeted_start=float(timings["targeted_start"]),
                request_start=float(timings["request_start"]),
                first_token=timings.get("first_token_iteration"),
                last_token=timings.get("last_token_iteration"),
                max_tokens=int(body.get("max_tokens") or 0),
                input_tokens=(r.get("input_metrics") or {}).get("text_tokens"),
                output_tokens=int((r.get("output_metrics") or {}).get("text_tokens") or 0),
            )
        )
    return out, failed


def _key(trace_s: float, output_tokens: int) -> tuple[float, int]:
    return round(trace_s, 4), output_tokens


def unrecorded(rows: list[dict[str, Any]], recs: list[Record]) -> int:
    """Rows of the trace that guidellm's output does not list (sent, but not in its report)."""
    t0 = rows[0]["timestamp"] if rows else 0.0
    want = Counter(_key(r["timestamp"] - t0, r["output_length"]) for r in rows)
    got = Counter(_key(r.trace_s, r.max_tokens) for r in recs)
    return sum((want - got).values())


def tokens_in_window(rec: Record, window_end: float) -> int:
    """Output tokens of `rec` whose time is <= window_end, assuming even spacing between the
    first and the last token."""
    n = rec.output_tokens
    if n <= 0 or rec.first_token is None or rec.last_token is None:
        return 0
    if rec.last_token <= window_end:
        return n
    if rec.first_token > window_end or n == 1:
        return 0
    gap = (rec.last_token - rec.first_token) / (n - 1)
    return min(n, 1 + math.floor((window_end - rec.first_token) / gap))


def figures(
    rows: dict[str, list[dict[str, Any]]],
    recs: dict[str, list[Record]],
    failed: dict[str, int],
    cfg: ClusterConfig,
) -> dict[str, Any]:
    """The replay figures from guidellm's records. `rows`/`recs`/`failed` by class. An online row
    guidellm did not report counts in neither numerator nor denominator (it is shown apart); an
    errored or incomplete one counts as missed."""
    origins = {c: recs[c][0].origin - rows[c][0]["timestamp"] for c in CLASSES if recs[c]}
    t0 = min(origins.values())
    slo = cfg.slo
    ttft, tpot, lag, ok = [], [], [], 0
    prompt_off = 0
    for r in recs["online"]:
        lag.append(r.request_start - r.targeted_start)
        prompt_off += r.input_tokens is not None and r.input_tokens != _row_input(rows, r)
        if r.first_token is None or r.last_token is None:
            continue
        t = r.first_token - r.request_start
        ttft.append(t)
        if r.output_tokens == r.max_tokens:
            n = r.output_tokens
            tp = (r.last_token - r.first_token) / (n - 1) if n > 1 else 0.0
            tpot.append(tp)
            ok += t <= slo.ttft_s and tp <= slo.tpot_s
    num_online = len(recs["online"]) + failed["online"]
    window_end = t0 + cfg.duration_s
    off_tokens = sum(tokens_in_window(r, window_end) for r in recs["offline"])
    return {
        "slo_attainment_pct": 100.0 * ok / max(1, num_online),
        "num_online": num_online,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "offline_tokens_per_s": off_tokens / cfg.duration_s,
        "dispatch_lag_p50_s": pct(lag, 50),
        "dispatch_lag_p99_s": pct(lag, 99),
        "prompt_tokens_mismatched": int(prompt_off),
        "start_offset_s": {c: origins[c] - t0 for c in origins},
        "unrecorded": {c: unrecorded(rows[c], recs[c]) for c in CLASSES},
        "failed": dict(failed),
    }


def _row_input(rows: dict[str, list[dict[str, Any]]], r: Record) -> int | None:
    t0 = rows["online"][0]["timestamp"]
    for row in rows["online"]:
        if _key(row["timestamp"] - t0, row["output_length"]) == _key(r.trace_s, r.max_tokens):
            return int(row["input_length"])
    return None


def shifted(reqs: list[SimRequest], offsets: dict[str, float]) -> list[SimRequest]:
    """The window as guidellm sent it: each class's arrivals moved by its process's start offset."""
    moved = [
        dataclasses.replace(r, arrival_s=r.arrival_s + offsets.get(str(r.req_class), 0.0))
        for r in reqs
    ]
    return sorted(moved, key=lambda r: r.arrival_s)  # the simulator takes arrivals in order


def replay(exe: str, base: str, model: str, reqs: list[SimRequest], cfg: ClusterConfig) -> dict:
    """Both classes' guidellm processes against `base`; returns `figures` (+ the command lines)."""
    with tempfile.TemporaryDirectory(prefix="tidal-guidellm-") as tmp_:
        tmp = Path(tmp_)
        tok = write_tokenizer(tmp / "tokenizer")
        rows = {c: trace_rows(reqs, c) for c in CLASSES}
        procs: dict[str, tuple[subprocess.Popen[bytes], Path, Any]] = {}
        cmds = {}
        try:
            for c in CLASSES:
                if not rows[c]:
                    continue
                write_trace(tmp / f"{c}.jsonl", [*rows[c], sentinel_row(rows[c], cfg)])
                cmd = guidellm_command(
                    exe, base, model, tmp / f"{c}.jsonl", tok, tmp / f"{c}.json", c
                )
                cmds[c] = cmd
                log = (tmp / f"{c}.log").open("wb")
                env = {**os.environ, **GUIDELLM_ENV}
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                procs[c] = (proc, tmp / f"{c}.json", log)
            for c, (proc, _, log) in procs.items():
                rc = proc.wait()
                log.close()
                if rc != 0:
                    tail = (tmp / f"{c}.log").read_text(errors="replace")[-2000:]
                    raise GuidellmError(f"guidellm ({c}) exited with {rc}:\n{tail}")
        finally:
            for proc, _, log in procs.values():
                if proc.poll() is None:
                    proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
                log.close()
        recs: dict[str, list[Record]] = {c: [] for c in CLASSES}
        failed = dict.fromkeys(CLASSES, 0)
        for c, (_, out, _) in procs.items():
            recs[c], failed[c] = parse_output(json.loads(out.read_text()))
            end = sentinel_row(rows[c], cfg)["timestamp"] - rows[c][0]["timestamp"]
            recs[c] = [r for r in recs[c] if _key(r.trace_s, r.max_tokens) != _key(end, 1)]
        fig = figures(rows, recs, failed, cfg)
    env_ = " ".join(f"{k}={v}" for k, v in GUIDELLM_ENV.items())
    fig["commands"] = {c: " ".join([env_, *map(_quote, cmd)]) for c, cmd in cmds.items()}
    fig["requests"] = [  # per request, as guidellm recorded it (Unix seconds)
        {"class": c, **dataclasses.asdict(r)} for c in CLASSES for r in recs[c]
    ]
    return fig


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(ch in arg for ch in ' {}"') else arg
