"""`tidal bench cpu-attn`: what CPU-attention workers (OmniServe §3.2) add to a live instance.

For each worker count in `--workers` (default 0,1,2) it starts `tidal up` (torch engine,
SmolLM2, policy `omniserve`, one aggregated instance whose KV pool is deliberately small,
`--kv-cache-tokens`), sends `--offline` offline requests of about `--context-tokens` prompt
tokens at once and, meanwhile, streamed online requests at `--online-rate`, for `--duration-s`
(or until the offline requests are done). It reports offline decode tokens/s, offline requests
in flight (median and peak, sampled every 0.25 s), online TPOT p50/p99, and from the workers'
heartbeats their attention time per layer frame. With
`--overhead` it also times the instance side of piggybacking (residual store and queues) at
several numbers of offloaded requests, on the engine alone.

On a CPU-only machine the instance's "GPU" is this CPU too, shared with the workers: the
figures show the mechanism and its capacity effect, not a GPU's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from typing import Any

from services.cli import natsd
from services.cli.benchkit import gateway_metrics, pct, save_json, stack

WORDS = ["tide", "wave", "shore", "moon", "current", "reef", "harbor", "sail", "drift", "foam"]


async def _phase(base: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=1800)
    model = (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    ctx = " ".join(rng.choice(WORDS) for _ in range(args.context_tokens))
    state = {"started": 0, "done": 0, "tokens": 0}
    first_token: list[float] = []
    tpots: list[float] = []

    async def offline(i: int) -> None:
        stream = await client.completions.create(
            model=model,
            prompt=f"{i} {ctx}",
            max_tokens=args.offline_max_tokens,
            temperature=0,
            stream=True,
            extra_body={"request_class": "offline", "ignore_eos": True},
        )
        got = 0
        async for c in stream:
            if c.choices and c.choices[0].text:
                if got == 0:
                    state["started"] += 1
                    first_token.append(time.perf_counter())
                got += 1
                state["tokens"] += 1
        state["done"] += 1

    async def online(i: int) -> None:
        stream = await client.completions.create(
            model=model,
            prompt=" ".join(rng.choice(WORDS) for _ in range(64)),
            max_tokens=args.online_max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        times = [time.perf_counter() async for c in stream if c.choices and c.choices[0].text]
        if len(times) > 1:
            tpots.append((times[-1] - times[0]) / (len(times) - 1))

    async def online_load(stop: asyncio.Event) -> None:
        tasks = []
        i = 0
        while not stop.is_set():
            tasks.append(asyncio.create_task(online(i)))
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.expovariate(args.online_rate))
        await asyncio.gather(*tasks, return_exceptions=True)

    m0 = await asyncio.to_thread(gateway_metrics, base)
    in_flight: list[int] = []
    offloaded: list[float] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    offl = [asyncio.create_task(offline(i)) for i in range(args.offline)]
    onl = asyncio.create_task(online_load(stop))
    end = t0 + args.duration_s
    while state["done"] < args.offline and time.perf_counter() < end:
        await asyncio.sleep(0.25)
        in_flight.append(state["started"] - state["done"])
        if len(in_flight) % 8 == 0:
            m = await asyncio.to_thread(gateway_metrics, base)
            offloaded.append(m.get("tidal_cpu_attn_offloaded_requests", 0.0))
    t1 = time.perf_counter()
    stop.set()
    for task in offl:  # the window is over: what is not done is cancelled (client disconnect)
        task.cancel()
    await asyncio.gather(*offl, onl, return_exceptions=True)
    m = await asyncio.to_thread(gateway_metrics, base)

    def delta(name: str) -> float:
        return m.get(name, 0.0) - m0.get(name, 0.0)

    rows = delta("tidal_cpu_attn_rows_total")
    ctx_read = delta("tidal_cpu_attn_context_tokens_total")
    layer_s = delta("tidal_cpu_attn_layer_seconds_sum")
    decode_s = t1 - (min(first_token) if first_token else t0)
    n_layer = m.get("tidal_cpu_attn_layer_seconds_count", 0.0)
    return {
        "offline_tokens": state["tokens"],
        "offline_done": state["done"],
        "offline_wall_s": round(t1 - t0, 2),
        "offline_decode_tokens_per_s": round(state["tokens"] / max(decode_s, 1e-9), 2),
        "offline_in_flight_median": statistics.median(in_flight) if in_flight else 0,
        "offline_in_flight_peak": max(in_flight, default=0),
        "offloaded_peak": max(offloaded, default=0.0),
        "online_requests": len(tpots),
        "online_tpot_p50_ms": round(1e3 * pct(tpots, 50), 1) if tpots else None,
        "online_tpot_p99_ms": round(1e3 * pct(tpots, 99), 1) if tpots else None,
        "offloads": m.get("tidal_offloads_total", 0.0),
        "recalls": m.get("tidal_recalls_total", 0.0),
        "worker_attn_rows": rows,
        "worker_attn_us_per_row": round(1e6 * layer_s / rows, 1) if rows else None,
        "worker_mean_context_tokens": round(ctx_read / rows) if rows else None,
        "worker_attn_ms_per_layer_frame": (
            round(1e3 * m.get("tidal_cpu_attn_layer_seconds_sum", 0.0) / n_layer, 3)
            if n_layer
            else None
        ),
    }


def _memory_gb_per_s() -> float:
    """This machine's copy bandwidth (read + write), one thread, median of 5: the ceiling a
    worker's attention streams KV at."""
    import torch

    n = 1 << 26  # 256 MiB of fp32
    a, b = torch.ones(n), torch.empty(n)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * 4 / statistics.median(times) / 1e9


def run(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {"copy_gb_per_s": round(_memory_gb_per_s(), 1)}
    for workers in args.workers.split(","):
        up = ["--engine", "torch", "--policy", "omniserve", "--instances", "aggregated"]
        up += ["--kv-cache-tokens", str(args.kv_cache_tokens), "--cpu-attn", workers]
        print(f"workers={workers}: starting the stack ...", flush=True)
        with stack(natsd.free_port(), *up) as base:
            results[workers] = r = asyncio.run(_phase(base, args))
        print(f"workers={workers}: {json.dumps(r)}", flush=True)
    if args.overhead:
        from services.cli.bench_piggyback import overhead_table

        results["overhead"] = overhead_table([int(x) for x in args.overhead.split(",")])
    print(
        f"\nCPU attention on the live stack (torch engine, SmolLM2, policy omniserve, KV pool "
        f"{args.kv_cache_tokens} tokens; {args.offline} offline requests of ~"
        f"{args.context_tokens} tokens x {args.offline_max_tokens} out; online "
        f"{args.online_rate}/s). CPU-only machine: the instance and the workers share its cores."
    )
    print("  workers  offline tok/s  in flight p50/peak  offloaded peak  online TPOT p50/p99 ms")
    for key, r in results.items():
        if not isinstance(r, dict) or "offline_decode_tokens_per_s" not in r:
            continue
        print(
            f"  {key:>7}  {r['offline_decode_tokens_per_s']:13.1f}  "
            f"{r['offline_in_flight_median']:>8}/{r['offline_in_flight_peak']:<8}  "
            f"{r['offloaded_peak']:14.0f}  {r['online_tpot_p50_ms']}/{r['online_tpot_p99_ms']}"
        )
    item = 2  # bf16, the dtype the embedded engine picks on this machine
    per_token_layer = 2 * 3 * 64 * item  # SmolLM2: K and V, 3 KV heads x 64
    print(f"  copy bandwidth here: {results['copy_gb_per_s']} GB/s (one thread, read + write)")
    for key, r in results.items():
        if not isinstance(r, dict) or not r.get("worker_attn_rows"):
            continue
        est_s = (
            r["worker_mean_context_tokens"] * per_token_layer / (results["copy_gb_per_s"] * 1e9 / 2)
        )
        print(
            f"  workers={key}: attention {r['worker_attn_us_per_row']} us per request-layer over "
            f"~{r['worker_mean_context_tokens']} tokens; streaming its KV once at half the copy "
            f"bandwidth would take {1e6 * est_s:.1f} us"
        )
    save_json(args.json, {"args": args} | results)
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "cpu-attn",
        help="offline capacity and online TPOT with 0, 1, 2 CPU-attention workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", default="0,1,2", help="worker counts to compare")
    p.add_argument("--kv-cache-tokens", type=int, default=4096, help="the instance's KV pool")
    p.add_argument("--offline", type=int, default=64, help="offline requests sent at once")
    p.add_argument("--context-tokens", type=int, default=1000, help="offline prompt, ~tokens")
    p.add_argument("--offline-max-tokens", type=int, default=32, help="offline output tokens")
    p.add_argument("--online-rate", type=float, default=0.2, help="online requests per second")
    p.add_argument(
        "--duration-s", type=float, default=240.0, help="measure this long (or until done)"
    )
    p.add_argument("--online-max-tokens", type=int, default=32, help="online output tokens")
    p.add_argument("--overhead", default="", help="also time piggybacking at these row counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the results here")
    p.set_defaults(func=run)
