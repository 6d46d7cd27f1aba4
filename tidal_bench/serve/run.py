"""`tidal bench serve`: what a user of `make up` sees: one stream at a time on the torch stack.

    tidal bench serve [--requests 8] [--max-tokens 64] [--prompt-words 200] [--json PATH]
                      [--compare-fixed-threads] [--compare URL [--compare-eos-id ID]]

Starts `tidal up` (torch engine, the embedded SmolLM2) and sends `--requests` streaming
`/v1/completions` one after another with the openai client: TTFT and inter-token latency medians.
`--compare-fixed-threads` runs the stack twice, with `--fixed-threads` (each instance keeps cores ÷
instances threads) and without (threads follow the load, `tidal.engine.torch.core_share`), and
prints both. The first request of each run is a warm-up, not counted.

`--compare-overlap` starts two stacks, one with the instances' overlap on and one with it off
(`TIDAL_OVERLAP`, services/instance/overlap.py), and their streams take turns the same way.

`--compare URL` puts any OpenAI-compatible server beside it in the same run (llama.cpp's
`python -m llama_cpp.server`, see docs/engine.md): requests take turns between the two, same
client, prompts and lengths, so load from other processes hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from typing import Any

from services.cli import natsd
from tidal_bench.kit import pct, save_json, stack
from tidal_bench.stream_timing import read_stream_sync

TEXT = "the quick brown fox jumps over the lazy dog while a small bird sings"


def _prompt(n_words: int, i: int) -> str:
    # a different opening per request: no prefix-cache hit from the previous one
    words = TEXT.split()
    return f"Request {i}: " + " ".join(words[(i + k) % len(words)] for k in range(n_words))


def _one_stream(
    client: Any, model: str, i: int, max_tokens: int, words: int, extra: dict[str, Any]
) -> tuple[float, list[float]]:
    """One streaming completion: (ms to the first text, ms gaps between later texts)."""
    t0 = time.perf_counter()
    stream = client.completions.create(
        model=model,
        prompt=_prompt(words, i),
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra,
    )
    stamps = read_stream_sync(stream).times
    if not stamps:
        return float("nan"), []
    return 1e3 * (stamps[0] - t0), [1e3 * (b - a) for a, b in itertools.pairwise(stamps)]


def _summary(n: int, ttft: list[float], itl: list[float]) -> dict[str, Any]:
    if not itl:
        raise RuntimeError("no stream produced two texts: nothing to time")
    return {
        "requests": n,
        "ttft_ms_p50": statistics.median(ttft),
        "itl_ms_p50": statistics.median(itl),
        "itl_ms_p90": pct(itl, 90),
        "itl_samples": len(itl),
        "tokens_per_s": 1e3 / statistics.median(itl),
    }


def single_streams(
    servers: dict[str, tuple[str, dict[str, Any]]], n: int, max_tokens: int, words: int
) -> dict[str, dict[str, Any]]:
    """Lone streams, one at a time, taking turns between `servers` (name -> (API base URL,
    extra request fields)), so a burst of load on a shared machine hits every server alike. The
    first request to each is a warm-up, not counted. Same client, prompts and lengths for all."""
    import openai

    clients = {
        k: openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        for k, (url, _) in servers.items()
    }
    models = {k: c.models.list().data[0].id for k, c in clients.items()}
    ttft: dict[str, list[float]] = {k: [] for k in servers}
    itl: dict[str, list[float]] = {k: [] for k in servers}
    for i in range(n + 1):
        for k, (_, extra) in servers.items():
            first, gaps = _one_stream(clients[k], models[k], i, max_tokens, words, extra)
            if i > 0 and gaps:  # the first round is a warm-up
                ttft[k].append(first)
                itl[k] += gaps
    for c in clients.values():
        c.close()
    return {k: _summary(n, ttft[k], itl[k]) | {"model": models[k]} for k in servers}


# generous SLOs: this measures latency, the policy's admission is not under test
TIDAL_EXTRA = {"ignore_eos": True, "slo_ttft_ms": 60000, "slo_tpot_ms": 60000}


def _outside_extra(args: argparse.Namespace) -> dict[str, Any]:
    """Request fields for the outside server: plain OpenAI ones (no `ignore_eos`); with
    --compare-eos-id the end-of-sequence token is banned by logit_bias, so both run full length."""
    return {"logit_bias": {str(args.compare_eos_id): -100}} if args.compare_eos_id >= 0 else {}


def _variants(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (`tidal up` arguments, environment) of each stack to measure."""
    if args.compare_fixed_threads:
        return {"fixed split": (["--fixed-threads"], {}), "threads follow load": ([], {})}
    if args.compare_overlap:
        return {"overlap": ([], {"TIDAL_OVERLAP": "1"}), "no overlap": ([], {"TIDAL_OVERLAP": "0"})}
    return {"threads follow load": ([], {})}


def run_serve(args: argparse.Namespace) -> int:
    variants = _variants(args)
    res: dict[str, Any] = {"max_tokens": args.max_tokens, "prompt_words": args.prompt_words}
    if args.compare:
        res["compare_url"] = args.compare
    # Overlap on and off run at once and take turns (a burst of load hits both alike); the
    # thread settings change how a stack uses every core, so those run one after the other.
    together = args.compare_overlap
    groups = [list(variants)] if together else [[name] for name in variants]
    for group in groups:
        with contextlib.ExitStack() as stacks:
            servers: dict[str, tuple[str, dict[str, Any]]] = {}
            for name in group:
                up_args, env = variants[name]
                up = ["--engine", "torch", *up_args, *args.up_arg]
                base = stacks.enter_context(stack(natsd.free_port(), *up, env=env))
                servers[name] = (base, TIDAL_EXTRA)
            if args.compare:
                servers[args.compare_name] = (args.compare, _outside_extra(args))
            res |= single_streams(servers, args.requests, args.max_tokens, args.prompt_words)
    print(f"one stream at a time, {args.requests} requests of {args.max_tokens} tokens (torch):")
    names = [*variants, args.compare_name] if args.compare else list(variants)
    for name in names:
        r = res[name]
        print(
            f"  {name:20s} TTFT p50 {r['ttft_ms_p50']:7.1f} ms   inter-token p50 "
            f"{r['itl_ms_p50']:6.1f} ms (p90 {r['itl_ms_p90']:6.1f})   "
            f"{r['tokens_per_s']:5.1f} tok/s"
        )
    if args.compare:
        for name in variants:
            ratio = res[name]["itl_ms_p50"] / res[args.compare_name]["itl_ms_p50"]
            print(f"  inter-token p50, {name} / {args.compare_name} (same run): {ratio:.2f}")
    if args.compare_overlap:
        ratio = res["overlap"]["itl_ms_p50"] / res["no overlap"]["itl_ms_p50"]
        print(f"  inter-token p50, overlap / no overlap (same run): {ratio:.3f}")
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
    p.add_argument(
        "--compare-overlap",
        action="store_true",
        help="two stacks at once, the instances' overlap on and off (TIDAL_OVERLAP), taking turns",
    )
    p.add_argument(
        "--compare",
        default="",
        metavar="URL",
        help="an OpenAI-compatible API base URL (e.g. llama.cpp's server, http://HOST:PORT/v1): "
        "its lone streams take turns with Tidal's, same client and prompts",
    )
    p.add_argument("--compare-name", default="llama.cpp", help="the --compare server's label")
    p.add_argument(
        "--compare-eos-id",
        type=int,
        default=-1,
        help="ban this token on the --compare server (logit_bias), as ignore_eos does on Tidal",
    )
    p.add_argument("--up-arg", action="append", default=[], help="extra `tidal up` argument")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run_serve)
