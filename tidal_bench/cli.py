"""`tidal bench ...`: benchmark commands. Figures are medians/percentiles from one run.

    tidal bench gateway [--streams 32] [--rounds 10] [--max-tokens 16] [--json PATH]

`gateway` starts `tidal up --engine sim --sim-step-model zero` (the engine takes no time, so all
latency measured is Tidal's own: gateway, scheduler round trip, NATS hops and the instance loop)
and drives it with the official openai client. `server_ttft_ms` is measured inside the gateway
(request arrival to first token); `client_ttft_ms` adds the client's own time, which on a small
machine is mostly the openai library competing with the stack for the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator

from services.cli import natsd
from tidal_bench.burst import run as burst_run
from tidal_bench.checkpoint import run as checkpoint_run
from tidal_bench.colocation import run as colocation_run
from tidal_bench.cpu_attn import run as cpu_attn_run
from tidal_bench.dataplane import migration
from tidal_bench.dataplane import run as dataplane_run
from tidal_bench.engine import dtype as engine_dtype
from tidal_bench.engine import run as engine_run
from tidal_bench.faults import run as faults_run
from tidal_bench.kit import pct as _pct
from tidal_bench.kit import save_json, stack
from tidal_bench.perf import run as perf_run
from tidal_bench.replay import run as replay_run
from tidal_bench.serve import batch, classes, idle, overload, sglang
from tidal_bench.serve import run as serve_run
from tidal_bench.stream_timing import read_stream


@contextlib.contextmanager
def _sim_stack(port: int) -> Iterator[str]:
    with stack(port, "--engine", "sim", "--sim-step-model", "zero") as base:
        yield base


async def _drive(base: str, streams: int, rounds: int, max_tokens: int) -> dict[str, list[float]]:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
    samples: dict[str, list[float]] = {
        "client_ttft_ms": [],
        "server_ttft_ms": [],
        "inter_token_ms": [],
    }

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        stream = await client.chat.completions.create(
            model="tidal-sim",
            messages=[{"role": "user", "content": f"bench {i}"}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        got = await read_stream(stream)
        if got.usage_extra:
            samples["server_ttft_ms"].append(got.usage_extra["tidal"]["server_ttft_ms"])
        if got.times:
            samples["client_ttft_ms"].append((got.times[0] - t0) * 1e3)
        samples["inter_token_ms"] += [(b - a) * 1e3 for a, b in itertools.pairwise(got.times)]

    try:
        await asyncio.gather(*(one(i) for i in range(streams)))  # warm-up round, not counted
        for values in samples.values():
            values.clear()
        for r in range(rounds):
            await asyncio.gather(*(one(r * streams + i) for i in range(streams)))
    finally:
        await client.close()
    return samples


def run_gateway(args: argparse.Namespace) -> int:
    with _sim_stack(natsd.free_port()) as base:
        samples = asyncio.run(_drive(base, args.streams, args.rounds, args.max_tokens))
    report: dict[str, object] = {
        "what": "gateway-added latency: sim engine with zero emulated step time",
        "emulated_engine": True,
        "streams": args.streams,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
    }
    print(
        f"Gateway-added latency (sim engine, zero emulated step time; {args.streams} concurrent "
        f"streams x {args.rounds} rounds, {args.max_tokens} tokens each):"
    )
    for name, values in samples.items():
        stats = {
            "p50": _pct(values, 50),
            "p99": _pct(values, 99),
            "mean": statistics.fmean(values),
            "n": len(values),
        }
        report[name] = stats
        print(
            f"  {name:15s} p50 {stats['p50']:7.2f} ms   p99 {stats['p99']:7.2f} ms   "
            f"(n={stats['n']})"
        )
    save_json(args.json, report)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (gateway overhead, engine throughput)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench = p.add_subparsers(dest="bench_cmd", required=True)
    gw = bench.add_parser("gateway", help="latency Tidal adds on top of the engine")
    gw.add_argument("--streams", type=int, default=32, help="concurrent streams")
    gw.add_argument("--rounds", type=int, default=10, help="rounds of concurrent streams")
    gw.add_argument("--max-tokens", type=int, default=16, help="tokens per stream")
    gw.add_argument("--json", default="", help="also write the figures here as JSON")
    gw.set_defaults(func=run_gateway)
    migration.register(bench)
    dataplane_run.register(bench)
    colocation_run.register(bench)
    replay_run.register(bench)
    serve_run.register(bench)
    batch.register(bench)
    overload.register(bench)
    classes.register(bench)
    idle.register(bench)
    cpu_attn_run.register(bench)
    sglang.register(bench)
    faults_run.register(bench)
    burst_run.register(bench)
    engine_run.register_bench(bench)
    engine_dtype.register(bench)
    perf_run.register(bench)
    checkpoint_run.register(bench)
