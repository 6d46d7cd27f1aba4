"""`tidal bench colocation`: online latency on the live stack alone and beside offline work.

Starts `tidal up` (torch engine and the embedded SmolLM2 by default, policy `tidal`), then runs
two phases of `--duration-s` each with the official openai client: online requests alone
(Poisson arrivals at `--online-rate`, streamed), then the same online load while
`--offline-streams` clients keep offline requests going back to back (or, with
`--offline-via batch`, while a Batch API batch of `--batch-lines` lines runs; its tokens/s come
from `tidal_batch_output_tokens_total`, and it is cancelled when the phase ends). Prints TTFT
and TPOT p50/p99 of the online requests and their SLO attainment in each phase, and the
offline output tokens per second gained. With `--engine sim` the timings are emulated, and say so.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from typing import Any

from services.cli import natsd
from tidal_bench.colocation.search_cli import add_search_args
from tidal_bench.kit import gateway_metrics, pct, save_json, stack
from tidal_bench.stream_timing import read_stream


async def _phase(base: str, model: str, args: argparse.Namespace, offline: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(args.seed)
    done: list[tuple[float, float]] = []  # (TTFT, TPOT) of each online request, seconds
    offline_tokens = 0
    count_from = time.monotonic() + args.warmup_s  # before it: warm-up, not counted
    end = count_from + args.duration_s
    words = [
        "tide",
        "wave",
        "shore",
        "moon",
        "current",
        "reef",
        "harbor",
        "sail",
        "drift",
        "foam",
        "coral",
        "kelp",
    ]

    def prompt(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    async def online(i: int) -> None:
        counted = time.monotonic() >= count_from
        t0 = time.perf_counter()
        stream = await client.completions.create(
            model=model,
            prompt=prompt(args.prompt_words),
            max_tokens=args.max_tokens,
            stream=True,
            extra_body={"request_class": "online"},
        )
        got = await read_stream(stream)
        first, last = (got.times[0], got.times[-1]) if got.times else (None, None)
        n = len(got.times)
        if counted and first is not None and last is not None:
            done.append((first - t0, (last - first) / (n - 1) if n > 1 else 0.0))

    async def offline_loop() -> None:
        nonlocal offline_tokens
        while time.monotonic() < end:
            r = await client.completions.create(
                model=model,
                prompt=prompt(args.offline_prompt_words),
                max_tokens=args.offline_max_tokens,
                extra_body={"request_class": "offline"},
            )
            if count_from <= time.monotonic() <= end and r.usage is not None:
                offline_tokens += r.usage.completion_tokens

    batch_id, tokens0 = "", 0.0
    if offline and args.offline_via == "batch":
        batch_id = await _submit_batch(client, model, args, prompt)
        offline = 0
    tasks = [asyncio.create_task(offline_loop()) for _ in range(offline)]
    arrivals = []
    i = 0
    while batch_id and time.monotonic() < count_from:
        arrivals.append(asyncio.create_task(online(i)))
        i += 1
        await asyncio.sleep(rng.expovariate(args.online_rate))
    if batch_id:
        tokens0 = await _batch_tokens(base)
    while time.monotonic() < end:
        arrivals.append(asyncio.create_task(online(i)))
        i += 1
        await asyncio.sleep(rng.expovariate(args.online_rate))
    await asyncio.gather(*arrivals, *tasks)
    if batch_id:
        offline_tokens = int(await _batch_tokens(base) - tokens0)
        await client.batches.cancel(batch_id)
    await client.close()
    ttft = [a for a, _ in done]
    tpot = [b for _, b in done]
    slo_ok = sum(1 for a, b in done if a <= args.ttft_slo_s and b <= args.tpot_slo_s)
    return {
        "online_requests": len(done),
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "tpot_p50_ms": 1e3 * pct(tpot, 50),
        "tpot_p99_ms": 1e3 * pct(tpot, 99),
        "slo_attainment": slo_ok / max(1, len(done)),
        "offline_tokens_per_s": offline_tokens / args.duration_s,
    }


async def _submit_batch(client: Any, model: str, args: argparse.Namespace, prompt: Any) -> str:
    rows = [
        {
            "custom_id": f"bench-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": model,
                "prompt": prompt(args.offline_prompt_words),
                "max_tokens": args.offline_max_tokens,
            },
        }
        for i in range(args.batch_lines)
    ]
    data = "\n".join(map(json.dumps, rows)).encode()
    f = await client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    return str(b.id)


async def _batch_tokens(base: str) -> float:
    """`tidal_batch_output_tokens_total` now (the batch service publishes it every second)."""
    await asyncio.sleep(1.1)
    metrics = await asyncio.to_thread(gateway_metrics, base)
    return metrics.get("tidal_batch_output_tokens_total", 0.0)


def run(args: argparse.Namespace) -> int:
    if args.search_offline:
        return _search(args)
    up = ["--engine", args.engine, "--policy", args.policy, "--cpu-attn", str(args.cpu_attn)]
    with stack(natsd.free_port(), *up) as base:
        import openai

        model = openai.OpenAI(base_url=base, api_key="unused").models.list().data[0].id
        alone = asyncio.run(_phase(base, model, args, offline=0))
        mixed = asyncio.run(_phase(base, model, args, offline=args.offline_streams))
    label = "emulated timings (sim engine)" if args.engine == "sim" else "real engine"
    print(
        f"Co-location on the live stack ({args.engine} engine, {label}; policy {args.policy}; "
        f"online {args.online_rate}/s for {args.duration_s:.0f} s per phase; SLO "
        f"TTFT {args.ttft_slo_s}s / TPOT {args.tpot_slo_s}s):"
    )
    print("  phase           n  TTFT p50  TTFT p99  TPOT p50  TPOT p99  SLO att.  offline tok/s")
    busy = f"+{args.offline_streams} offline"
    if args.offline_via == "batch":
        busy = "+batch"
    for name, r in (("online alone", alone), (busy, mixed)):
        print(
            f"  {name:13s} {r['online_requests']:3d}  {r['ttft_p50_ms']:6.0f}ms "
            f"{r['ttft_p99_ms']:7.0f}ms  {r['tpot_p50_ms']:6.1f}ms  {r['tpot_p99_ms']:6.1f}ms  "
            f"{100 * r['slo_attainment']:6.1f}%  {r['offline_tokens_per_s']:13.1f}"
        )
    save_json(args.json, {"args": args, "alone": alone, "with_offline": mixed})
    return 0


def _search(args: argparse.Namespace) -> int:
    from tidal_bench.colocation.search_cli import run_search

    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()] or [args.policy]
    args.without_cpu_attn = [p.strip() for p in args.without_cpu_attn.split(",") if p.strip()]
    if not args.config:
        args.config = "configs/ooco.yaml" if args.engine == "sim" else "configs/embedded.yaml"
    return run_search(args)


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "colocation",
        help="online TTFT/TPOT on the live stack alone and beside offline work",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", default="torch", choices=("torch", "sim"), help="instance engine")
    p.add_argument("--policy", default="tidal", help="scheduling policy")
    p.add_argument("--duration-s", type=float, default=60.0, help="length of each phase")
    p.add_argument(
        "--warmup-s", type=float, default=5.0, help="warm-up opening each phase/window, not counted"
    )
    p.add_argument("--online-rate", type=float, default=0.5, help="online requests per second")
    p.add_argument("--prompt-words", type=int, default=100, help="online prompt length, words")
    p.add_argument("--max-tokens", type=int, default=32, help="online output tokens")
    p.add_argument("--offline-streams", type=int, default=4, help="concurrent offline clients")
    p.add_argument(
        "--offline-via",
        default="clients",
        choices=("clients", "batch"),
        help="offline load: back-to-back client requests, or one Batch API batch",
    )
    p.add_argument("--batch-lines", type=int, default=2000, help="lines of the offline batch")
    p.add_argument("--offline-prompt-words", type=int, default=200, help="offline prompt words")
    p.add_argument("--offline-max-tokens", type=int, default=64, help="offline output tokens")
    p.add_argument("--ttft-slo-s", type=float, default=3.0, help="online TTFT SLO (config's)")
    p.add_argument("--tpot-slo-s", type=float, default=0.25, help="online TPOT SLO (config's)")
    p.add_argument("--seed", type=int, default=0, help="prompt and arrival randomness")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    add_search_args(p)
    p.set_defaults(func=run)
