"""`tidal bench batch`: the Batch API's control plane, measured.

Starts `tidal up --engine sim --sim-step-model zero` (emulated engine, zero step time: what is
left is Tidal's own path), then per repeat uploads a `--lines`-line file with the official
openai client, creates the batch and polls it every 10 ms. Reports the upload time, submit ->
first line done (the dispatch latency plus one zero-time request), submit -> completed, and the
control-plane throughput in lines/s; medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from typing import Any

from services.cli import natsd
from tidal_bench.kit import save_json, stack

MODEL = "tidal-sim"


def _one(client: Any, lines: int, max_tokens: int) -> dict[str, float]:
    rows = [
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": max_tokens},
        }
        for i in range(lines)
    ]
    data = "\n".join(map(json.dumps, rows)).encode()
    t0 = time.perf_counter()
    f = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    t_up = time.perf_counter()
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    t_first = None
    while b.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.01)
        b = client.batches.retrieve(b.id)
        if t_first is None and b.request_counts is not None and b.request_counts.completed:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    if b.status != "completed":
        raise RuntimeError(f"the benchmark batch ended {b.status}: {b.errors}")
    return {
        "upload_s": t_up - t0,
        "first_line_s": (t_first or t_end) - t_up,
        "total_s": t_end - t_up,
        "lines_per_s": lines / (t_end - t_up),
    }


def run(args: argparse.Namespace) -> int:
    up = ["--engine", "sim", "--sim-step-model", "zero", "--cpu-attn", "0"]
    with stack(natsd.free_port(), *up) as base:
        import openai

        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
        runs = [_one(client, args.lines, args.max_tokens) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"Batch API control plane (sim engine, zero emulated step time; {args.lines} lines of "
        f"{args.max_tokens} token(s); median of {args.repeats}):"
    )
    print(f"  upload              {1e3 * med['upload_s']:8.1f} ms")
    print(f"  submit -> 1st line  {1e3 * med['first_line_s']:8.1f} ms")
    print(f"  submit -> completed {med['total_s']:8.2f} s")
    print(f"  throughput          {med['lines_per_s']:8.1f} lines/s")
    save_json(args.json, {"args": args, "runs": runs, "median": med})
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "batch",
        help="Batch API control-plane throughput and dispatch latency (sim engine)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--lines", type=int, default=1000, help="lines per batch")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per line")
    p.add_argument("--repeats", type=int, default=3, help="batches run, one after another")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
