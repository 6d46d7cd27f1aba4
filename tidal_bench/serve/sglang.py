"""`tidal bench sglang`: the latency Tidal adds in front of a real SGLang server.

    tidal bench sglang --sglang-url URL --model DIR [--requests 20] [--max-tokens 64]

Side by side on the same server, one request at a time, greedy with `ignore_eos` so both paths
produce the same tokens: (a) SGLang alone, a streamed native `/generate` with Tidal's token ids;
(b) the openai client -> gateway -> `--engine sglang` instance (policy `aggregated`, one
instance) -> the same server, the two paths alternating request by request. Per request: the
TTFT difference; per token: the difference of the mean inter-token times. Medians over
`--requests`, after one warm-up request each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

from services.cli import natsd
from tidal.engine.tokenizer import load_tokenizer
from tidal_bench.kit import stack
from tidal_bench.stream_timing import read_stream_sync

PROMPT = "Tell me about the history of the lighthouse, in detail."


def _alone(url: str, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT s, mean inter-token s) of one streamed `/generate` straight to SGLang."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        url.rstrip("/") + "/generate",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    times: list[float] = []
    seen = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            n = int(json.loads(line[5:])["meta_info"]["completion_tokens"])
            times += [time.perf_counter()] * (n - seen)
            seen = n
    return _figures(t0, times)


def _through_tidal(base: str, model: str, max_tokens: int) -> tuple[float, float]:
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    t0 = time.perf_counter()
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    got = read_stream_sync(stream)
    times, n = got.times, got.num_tokens or 0
    # a chunk can carry more than one token (text held back for an incomplete character):
    # the first and last chunk times span n - 1 token gaps
    return _figures(t0, [times[0]] + [times[-1]] * (n - 1) if times and n > 1 else times)


def _figures(t0: float, times: list[float]) -> tuple[float, float]:
    """(TTFT s, mean inter-token s) from each token's arrival time."""
    if len(times) < 2:
        raise RuntimeError("a stream brought fewer than 2 tokens")
    return times[0] - t0, (times[-1] - times[0]) / (len(times) - 1)


def run(args: argparse.Namespace) -> int:
    ids = load_tokenizer(args.model).encode(PROMPT)
    up = ["--engine", "sglang", "--model", args.model, "--sglang-urls", args.sglang_url]
    up += ["--instances", "aggregated", "--policy", "aggregated", "--cpu-attn", "0"]
    alone: list[tuple[float, float]] = []
    tidal: list[tuple[float, float]] = []
    with stack(natsd.free_port(), *up, start_timeout_s=600) as base:
        with urllib.request.urlopen(base + "/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        # alternating, so both paths see the same machine (a shared, noisy one included)
        for _ in range(args.requests + 1):
            alone.append(_alone(args.sglang_url, ids, args.max_tokens))
            tidal.append(_through_tidal(base, model, args.max_tokens))
    alone, tidal = alone[1:], tidal[1:]  # the warm-up pair
    med = statistics.median
    report = {
        "what": "latency Tidal's sglang backend adds beside SGLang alone (same server)",
        "sglang_url": args.sglang_url,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "sglang_ttft_ms": med(a[0] for a in alone) * 1e3,
        "tidal_ttft_ms": med(t[0] for t in tidal) * 1e3,
        "sglang_itl_ms": med(a[1] for a in alone) * 1e3,
        "tidal_itl_ms": med(t[1] for t in tidal) * 1e3,
    }
    report["added_per_request_ms"] = report["tidal_ttft_ms"] - report["sglang_ttft_ms"]
    report["added_per_token_ms"] = report["tidal_itl_ms"] - report["sglang_itl_ms"]
    print(
        f"SGLang alone: TTFT {report['sglang_ttft_ms']:.1f} ms, ITL {report['sglang_itl_ms']:.2f} "
        f"ms; through Tidal: TTFT {report['tidal_ttft_ms']:.1f} ms, ITL "
        f"{report['tidal_itl_ms']:.2f} ms; added {report['added_per_request_ms']:+.1f} ms per "
        f"request, {report['added_per_token_ms']:+.2f} ms per token (medians, n={args.requests})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("sglang", help="latency the sglang backend adds beside SGLang alone")
    p.add_argument("--sglang-url", required=True, help="a running SGLang server")
    p.add_argument("--model", required=True, help="its model directory (Tidal's tokenizer)")
    p.add_argument("--requests", type=int, default=20, help="requests per path")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
