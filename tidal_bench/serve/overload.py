"""`tidal bench overload`: online arrivals at many times what the stack serves within SLO.

Starts `tidal up --engine sim` with a step model whose prefill is slow enough to saturate
(`--sim-step-model`, emulated timings), then sends online requests at `--rate` per second for
`--duration-s` (Poisson arrivals, `--prompt-tokens`-token prompts, streamed) with the SLO in each
request's headers. The policy's admission control (OmniServe §3.3.3 in `tidal`) should turn the
excess away at once with 429/503 and `Retry-After`, so that what it admits meets its SLO, instead
of every request's latency growing without bound. Prints the share rejected, the rejection
latency p50/p99 and the admitted requests' SLO attainment and TTFT/TPOT p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from services.cli import natsd
from tidal_bench.kit import pct, save_json, stack

MODEL = "tidal-sim"
# Words that are one SmolLM2 token each (with their leading space): a prompt of N of them is N
# tokens, as the sim engine counts them.
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "an",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
    "who",
    "may",
    "down",
    "side",
    "been",
    "now",
    "find",
]


async def drive(base: str, args: argparse.Namespace) -> dict[str, Any]:
    """The load and its outcome (used by the benchmark and by `tests/fault/test_overload.py`)."""
    import httpx

    rng = random.Random(args.seed)
    headers = {
        "X-Tidal-TTFT-Ms": str(args.ttft_slo_ms),
        "X-Tidal-TPOT-Ms": str(args.tpot_slo_ms),
    }
    admitted: list[tuple[float, float]] = []  # (TTFT, TPOT) seconds
    rejected: list[float] = []  # seconds to the rejection
    other: list[int] = []
    no_retry_after = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal no_retry_after
        body = {
            "model": MODEL,
            "prompt": " ".join(
                _WORDS[(i + 7 * k) % len(_WORDS)] for k in range(args.prompt_tokens)
            ),
            "max_tokens": args.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        async with client.stream("POST", "/completions", json=body, headers=headers) as r:
            if r.status_code in (429, 503):
                await r.aread()
                rejected.append(time.perf_counter() - t0)
                no_retry_after += "retry-after" not in r.headers
                return
            if r.status_code != 200:
                other.append(r.status_code)
                return
            first = last = None
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                    last = time.perf_counter()
                    first = first or last
                    n += 1
            if first is not None and last is not None:
                admitted.append((first - t0, (last - first) / max(1, n - 1)))

    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        tasks = []
        end = time.monotonic() + args.duration_s
        i = 0
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(client, i)))
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    ok = [
        1
        for ttft, tpot in admitted
        if ttft * 1e3 <= args.ttft_slo_ms and tpot * 1e3 <= args.tpot_slo_ms
    ]
    return {
        "sent": i,
        "admitted": len(admitted),
        "rejected": len(rejected),
        "other_status": other,
        "rejections_without_retry_after": no_retry_after,
        "reject_p50_ms": 1e3 * pct(rejected, 50) if rejected else None,
        "reject_p99_ms": 1e3 * pct(rejected, 99) if rejected else None,
        "admitted_attainment": len(ok) / len(admitted) if admitted else None,
        "ttft_p50_ms": 1e3 * pct([a for a, _ in admitted], 50) if admitted else None,
        "ttft_p99_ms": 1e3 * pct([a for a, _ in admitted], 99) if admitted else None,
        "tpot_p50_ms": 1e3 * pct([b for _, b in admitted], 50) if admitted else None,
        "tpot_p99_ms": 1e3 * pct([b for _, b in admitted], 99) if admitted else None,
    }


def _fmt(v: float | None, unit: str = "ms") -> str:
    return "-" if v is None else f"{v:.1f} {unit}"


def run(args: argparse.Namespace) -> int:
    up = ["--engine", "sim", "--sim-step-model", args.sim_step_model, "--cpu-attn", "0"]
    with stack(natsd.free_port(), *up) as base:
        r = asyncio.run(drive(base, args))
    att = r["admitted_attainment"]
    print(
        f"Overload (sim engine, emulated timings, step model {args.sim_step_model}; online "
        f"{args.rate}/s for {args.duration_s:.0f} s, {args.prompt_tokens}-token prompts, SLO TTFT "
        f"{args.ttft_slo_ms} ms / TPOT {args.tpot_slo_ms} ms):"
    )
    share = 100 * r["rejected"] / max(1, r["sent"])
    print(f"  sent {r['sent']}, admitted {r['admitted']}, rejected {r['rejected']} "
          f"({share:.0f}%), other {r['other_status']}")  # fmt: skip
    print(f"  rejection latency p50 {_fmt(r['reject_p50_ms'])}, p99 {_fmt(r['reject_p99_ms'])}; "
          f"without Retry-After: {r['rejections_without_retry_after']}")  # fmt: skip
    print(f"  admitted: SLO attainment {'-' if att is None else f'{100 * att:.1f}%'}, TTFT p50 "
          f"{_fmt(r['ttft_p50_ms'])} p99 {_fmt(r['ttft_p99_ms'])}, TPOT p50 "
          f"{_fmt(r['tpot_p50_ms'])} p99 {_fmt(r['tpot_p99_ms'])}")  # fmt: skip
    save_json(args.json, {"args": args, **r})
    return 0


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=25.0, help="online arrivals per second")
    p.add_argument("--duration-s", type=float, default=10.0, help="how long they arrive")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="prompt length, tokens")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="TTFT SLO sent per request")
    p.add_argument("--tpot-slo-ms", type=float, default=200.0, help="TPOT SLO sent per request")
    p.add_argument("--seed", type=int, default=0, help="arrival randomness")


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "overload",
        help="online load far past capacity: fast rejections, admitted requests within SLO",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_load_args(p)
    p.add_argument(
        "--sim-step-model",
        default="linear:0.02,0.0003,0,0",
        help="emulated step time (base s, s per token, ...): a 1500-token prefill takes ~0.5 s",
    )
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
