"""`tidal bench serve`: what a user of `make up` sees: one stream at a time on the torch stack.

    tidal bench serve [--requests 8] [--max-tokens 64] [--prompt-words 200] [--json PATH]
                      [--compare-fixed-threads]

Starts `tidal up` (torch engine, the embedded SmolLM2) and sends `--requests` streaming
`/v1/completions` one after another with the openai client: TTFT and inter-token latency medians.
`--compare-fixed-threads` runs the stack twice, with `--fixed-threads` (each instance keeps
cores ÷ instances threads) and without (threads follow the load, `tidal.engine.core_share`), and
prints both. The first request of each run is a warm-up, not counted.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

from services.cli import natsd
from services.cli.benchkit import pct, save_json, stack

TEXT = "the quick brown fox jumps over the lazy dog while a small bird sings"


def _prompt(n_words: int, i: int) -> str:
    # a different opening per request: no prefix-cache hit from the previous one
    words = TEXT.split()
    return f"Request {i}: " + " ".join(words[(i + k) % len(words)] for k in range(n_words))


def _single_streams(base: str, n: int, max_tokens: int, words: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    ttft: list[float] = []
    itl: list[float] = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        stamps: list[float] = []
        stream = client.completions.create(
            model=model,
            prompt=_prompt(words, i),
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            # generous SLOs: this measures latency, the policy's admission is not under test
            extra_body={"ignore_eos": True, "slo_ttft_ms": 60000, "slo_tpot_ms": 60000},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
        if i == 0 or not stamps:
            continue  # warm-up
        ttft.append(1e3 * (stamps[0] - t0))
        itl += [1e3 * (b - a) for a, b in itertools.pairwise(stamps)]
    client.close()
    return {
        "requests": n,
        "ttft_ms_p50": statistics.median(ttft),
        "itl_ms_p50": statistics.median(itl),
        "itl_ms_p90": pct(itl, 90),
        "tokens_per_s": 1e3 / statistics.median(itl),
    }


def run_serve(args: argparse.Namespace) -> int:
    variants: dict[str, list[str]] = {"threads follow load": []}
    if args.compare_fixed_threads:
        variants = {"fixed split": ["--fixed-threads"], "threads follow load": []}
    res: dict[str, Any] = {"max_tokens": args.max_tokens, "prompt_words": args.prompt_words}
    for name, extra in variants.items():
        up = ["--engine", "torch", *extra, *args.up_arg]
        with stack(natsd.free_port(), *up) as base:
            res[name] = _single_streams(base, args.requests, args.max_tokens, args.prompt_words)
    print(f"one stream at a time, {args.requests} requests of {args.max_tokens} tokens (torch):")
    for name in variants:
        r = res[name]
        print(
            f"  {name:20s} TTFT p50 {r['ttft_ms_p50']:7.1f} ms   inter-token p50 "
            f"{r['itl_ms_p50']:6.1f} ms (p90 {r['itl_ms_p90']:6.1f})   "
            f"{r['tokens_per_s']:5.1f} tok/s"
        )
    save_json(args.json, res)
    return 0


def register(bench: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench.add_parser(
        "serve",
        help="one stream at a time on the torch stack: TTFT and inter-token latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=8, help="requests, one at a time")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-words", type=int, default=200, help="prompt length in words")
    p.add_argument(
        "--compare-fixed-threads",
        action="store_true",
        help="also run with --fixed-threads and print both",
    )
    p.add_argument("--up-arg", action="append", default=[], help="extra `tidal up` argument")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run_serve)
