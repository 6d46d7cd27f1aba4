"""`tidal bench cpu-attn`: what CPU-attention workers (OmniServe §3.2) add to a live instance,
at the same engine cores.

For each worker count in `--workers` (default 0,1,2) it starts `tidal up` (torch engine,
SmolLM2, policy `omniserve`, one aggregated instance whose KV pool is deliberately small,
`--kv-cache-tokens`) with the engine pinned to `--engine-cores` (default 0), the workers to
`--cpu-attn-cores` (default 1) and the control plane and this client to `--service-cores`
(default: the workers' cores), so the engine's cores are the same, and its own, in every phase.
After a short warm-up it sends `--offline` offline requests of about `--context-tokens` prompt
tokens at once and, meanwhile, streamed online requests at `--online-rate`, for `--duration-s`
(or until the offline requests are done). It reports offline decode tokens/s and its gain over
0 workers, offline requests in flight (median and peak, sampled every 0.25 s), online TPOT
p50/p99, and the workers' attention time per instance step against its memory-bandwidth bound
(KV bytes read ÷ copy bandwidth measured on the worker's core; `tidal_bench.cpu_attn.bound`). With
`--overhead` it also times the instance side of piggybacking (residual store and queues) at
several numbers of offloaded requests, on the engine alone.

On a CPU-only machine the instance's "GPU" is a CPU core: the figures show the mechanism and its
capacity effect, not a GPU's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from typing import Any

from services.cli import natsd
from services.common import affinity
from tidal_bench.cpu_attn.bound import live_bound, measure, on_cores
from tidal_bench.kit import CpuClock, children_of, gateway_metrics, pct, save_json, stack, up_pid
from tidal_bench.stream_timing import read_stream

WORDS = ["tide", "wave", "shore", "moon", "current", "reef", "harbor", "sail", "drift", "foam"]


async def _phase(base: str, args: argparse.Namespace, pids: dict[str, int]) -> dict[str, Any]:
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
        times = (await read_stream(stream)).times
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

    for i in range(args.warmup):  # the engine's first steps allocate and warm caches
        await online(-1 - i)
    tpots.clear()
    m0 = await asyncio.to_thread(gateway_metrics, base)
    clock, load0 = CpuClock(pids), os.getloadavg()[0]
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
    cpu = clock.read() | {"loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    stop.set()
    for task in offl:  # the window is over: what is not done is cancelled (client disconnect)
        task.cancel()
    await asyncio.gather(*offl, onl, return_exceptions=True)
    await client.close()
    m = await asyncio.to_thread(gateway_metrics, base)

    def delta(name: str) -> float:
        return m.get(name, 0.0) - m0.get(name, 0.0)

    rows = delta("tidal_cpu_attn_rows_total")
    decode_s = t1 - (min(first_token) if first_token else t0)
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
        "offloads": delta("tidal_offloads_total"),
        "recalls": delta("tidal_recalls_total"),
        "worker_attn_rows": rows,
        "worker_attn_frames": delta("tidal_cpu_attn_layer_seconds_count"),
        "worker_attn_s": round(delta("tidal_cpu_attn_layer_seconds_sum"), 4),
        "worker_ctx_tokens": delta("tidal_cpu_attn_context_tokens_total"),
        "worker_mean_context_tokens": (
            round(delta("tidal_cpu_attn_context_tokens_total") / rows) if rows else None
        ),
        "cpu": cpu,
    }


def _shares(cpu: dict[str, Any], cores: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """How much CPU the engine and the workers got in the window (1.0 = one core throughout),
    and how busy their cores were with everything on the machine."""
    w = max(cpu["window_s"], 1e-9)
    workers = sum(v for k, v in cpu["cpu_s"].items() if k.startswith("cpu-attn"))

    def busy(cs: tuple[int, ...]) -> float:
        return round(statistics.mean(cpu["core_busy"].get(c, 0.0) for c in cs), 2)

    return {
        "engine_cpu_cores": round(cpu["cpu_s"].get("instance-0", 0.0) / w, 2),
        "workers_cpu_cores": round(workers / w, 2),
        "engine_cores_busy": busy(cores["engine"]),
        "worker_cores_busy": busy(cores["cpu_attn"]),
    }


def _cores(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """The run's core lists, checked (ValueError saying what is wrong)."""
    engine = affinity.parse_cores(args.engine_cores, "--engine-cores")
    workers = affinity.parse_cores(args.cpu_attn_cores, "--cpu-attn-cores")
    service = affinity.parse_cores(args.service_cores or args.cpu_attn_cores, "--service-cores")
    affinity.check_disjoint(**{"--engine-cores": engine, "--cpu-attn-cores": workers})
    return {"engine": engine, "cpu_attn": workers, "service": service}


def run(args: argparse.Namespace) -> int:
    try:
        cores = _cores(args)
    except ValueError as exc:
        print(f"tidal bench cpu-attn: {exc}")
        return 2
    fmt = {k: affinity.format_cores(v) for k, v in cores.items()}
    first_worker = affinity.split_cores(cores["cpu_attn"], 1)[0]
    print(f"bandwidth and isolated attention on core(s) {fmt['cpu_attn']} ...", flush=True)
    bound = measure(first_worker, args.offline, args.context_tokens, args.dtype)
    bw = bound["copy_gb_per_s"]
    results: dict[str, Any] = {
        "engine": f"torch, SmolLM2-135M, {args.dtype} (real timings, CPU only)",
        "cores": fmt | {"bench_client": fmt["service"]},
        "worker_core_bound": bound,
    }
    phases: dict[str, dict[str, Any]] = {}
    for workers in args.workers.split(","):
        up = ["--engine", "torch", "--policy", "omniserve", "--instances", "aggregated"]
        up += ["--kv-cache-tokens", str(args.kv_cache_tokens), "--cpu-attn", workers]
        up += ["--dtype", args.dtype, "--engine-cores", fmt["engine"]]
        up += ["--cpu-attn-cores", fmt["cpu_attn"], "--service-cores", fmt["service"]]
        slices = [
            affinity.format_cores(c) for c in affinity.split_cores(cores["cpu_attn"], int(workers))
        ]
        print(f"workers={workers}: starting the stack ...", flush=True)
        # The client on the service cores; not `tidal up` itself, which must see every core to
        # place its children (it pins each of them).
        port = natsd.free_port()
        one_chunk_a_token = {"TIDAL_OFFLINE_CHUNK_TOKENS": "1"}  # `_phase` counts chunks
        with stack(port, *up, env=one_chunk_a_token) as base, on_cores(cores["service"]):
            r = asyncio.run(_phase(base, args, children_of(up_pid(port))))
        r["worker_cores"] = slices
        r |= live_bound(r, bw, args.dtype) | _shares(r["cpu"], cores)
        phases[workers] = r
        print(f"workers={workers}: {json.dumps(r)}", flush=True)
    base_tps = phases.get("0", {}).get("offline_decode_tokens_per_s")
    for r in phases.values():
        tps = r["offline_decode_tokens_per_s"]
        r["offline_gain_vs_0"] = round(tps / base_tps, 2) if base_tps else None
    results["phases"] = phases
    if args.overhead:
        from tidal_bench.cpu_attn.piggyback import overhead_table

        results["overhead"] = overhead_table([int(x) for x in args.overhead.split(",")])
    _print_table(args, results)
    save_json(args.json, {"args": args} | results)
    return 0


def _print_table(args: argparse.Namespace, results: dict[str, Any]) -> None:
    c, b = results["cores"], results["worker_core_bound"]
    print(
        f"\nCPU attention on the live stack ({results['engine']}; policy omniserve, KV pool "
        f"{args.kv_cache_tokens} tokens; {args.offline} offline requests of ~"
        f"{args.context_tokens} tokens x {args.offline_max_tokens} out; online "
        f"{args.online_rate}/s). Cores: engine {c['engine']}, CPU-attention workers "
        f"{c['cpu_attn']}, control plane and client {c['service']}."
    )
    print(
        "  workers  worker cores  offline tok/s  gain  in flight p50/peak  TPOT p50/p99 ms  "
        "attn ms/step  KV MB/step  bound ms/step  x bound  engine CPU (core busy)  workers CPU"
    )
    for key, r in results["phases"].items():
        gain = r["offline_gain_vs_0"]
        print(
            f"  {key:>7}  {'/'.join(r['worker_cores']) or '-':>12}  "
            f"{r['offline_decode_tokens_per_s']:13.2f}  {gain if gain is not None else '-':>4}  "
            f"{r['offline_in_flight_median']:>8}/{r['offline_in_flight_peak']:<8}  "
            f"{r['online_tpot_p50_ms']}/{r['online_tpot_p99_ms']:<10}  "
            f"{r['attn_ms_per_step'] or '-':>12}  {r['kv_mb_per_step'] or '-':>10}  "
            f"{r['bound_ms_per_step'] or '-':>13}  {r.get('x_bound', '-'):>7}  "
            f"{r['engine_cpu_cores']:>10} ({r['engine_cores_busy']})  "
            f"{r['workers_cpu_cores']} ({r['worker_cores_busy']})"
        )
    iso = b["isolated"]
    print(
        f"  worker core(s) {b['cores']}: copy bandwidth {b['copy_gb_per_s']} GB/s (STREAM Copy, "
        f"{b['threads']} thread(s)); attention alone there: {iso['us_per_frame']} us per layer "
        f"frame of {iso['rows']} requests x {iso['context_tokens']} tokens "
        f"({iso['kv_kb_per_frame']} KB of KV; bound {iso['bound_us_per_frame']} us, "
        f"x{iso['x_bound']}; {iso['cpu_us_per_frame']} us of CPU time)"
    )
    print(
        "  engine CPU / workers CPU: cores' worth of CPU time each got in the window; "
        "(core busy): their cores' busy fraction with everything on the machine"
    )


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
    p.add_argument("--engine-cores", default="0", help="the instance's cores, in every phase")
    p.add_argument(
        "--cpu-attn-cores", default="1", help="the workers' cores (disjoint from the engine's)"
    )
    p.add_argument(
        "--service-cores", default="", help="control plane and this client (default: workers')"
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="engine and KV dtype"
    )
    p.add_argument("--warmup", type=int, default=2, help="online requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the results here")
    p.set_defaults(func=run)
