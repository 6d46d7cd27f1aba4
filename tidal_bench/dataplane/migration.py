"""`tidal bench migration`: what moving a request between instances costs on the real engine.

For each context length, one request of that many prompt tokens is prefilled on a torch engine
(the embedded SmolLM2 unless `--model`), then its KV is streamed block by block over the KV data
plane (`services.instance.dataplane`, a TCP connection on loopback) into a second engine's
blocks, which decodes its next token; that token must equal the one the source (which keeps its
copy) decodes. Also the layer-boundary preemption latency of a prefill beside one layer's time.
Figures are medians of `--runs` runs, measured on this machine's CPU (the "GPU" of an instance
here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from tidal_bench.kit import save_json


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from services.instance.dataplane import DataPlaneServer, EngineReceiver, send_kv
    from tidal.engine.api import EngineRequest, SamplingParams
    from tidal.engine.torch.loader import load_torch_engine
    from tidal_bench.engine.measure import preempt_latency

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    kv_tokens = max(args.tokens) + 64
    kw: dict[str, Any] = {"kv_cache_tokens": kv_tokens, "max_model_len": kv_tokens}
    src = load_torch_engine(args.model or None, **kw)
    dst = load_torch_engine(args.model or None, **kw)
    vocab = src.model.config.vocab_size
    too_long = [n for n in args.tokens if n + 2 > src.max_model_len]
    if too_long:
        raise SystemExit(
            f"--tokens {too_long}: the model holds at most {src.max_model_len} tokens "
            "(prompt + 2 output)"
        )
    out: dict[str, Any] = {"model": src.model_name, "dtype": str(src.model.dtype), "sizes": []}

    async def transfer(rid: str) -> tuple[int, float]:
        """Stream the request's KV from src's blocks into dst's; the source keeps its copy."""
        receiver = EngineReceiver(dst)
        plane = DataPlaneServer(receiver)
        url = await plane.start()
        source = src.begin_export(rid)
        try:
            secs = await send_kv(url, "bench", source)
        finally:
            src.end_export(rid, moved=False)  # the source goes on, as a reference
            await plane.close()
        if receiver.committed != [rid]:
            raise AssertionError(f"{rid}: the transfer did not land: {receiver.errors}")
        return source.num_tokens * source.bytes_per_token, secs

    for n in args.tokens:
        runs: dict[str, list[float]] = {"transfer_ms": [], "end_to_end_ms": []}
        nbytes = 0
        for r in range(args.runs):
            g = torch.Generator().manual_seed(n * 100 + r)
            prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
            rid = f"m{n}-{r}"
            src.add(EngineRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0)))
            while not src.step().events:  # the prefill, in the engine's own chunks
                pass
            t0 = time.perf_counter()
            nbytes, transfer_s = asyncio.run(transfer(rid))
            t1 = time.perf_counter()
            moved, ref = dst.step().events, src.step().events
            if [e.token_ids for e in moved] != [e.token_ids for e in ref]:
                raise AssertionError(f"{n} tokens: the migrated request decoded differently")
            runs["transfer_ms"].append(transfer_s * 1e3)
            runs["end_to_end_ms"].append((t1 - t0) * 1e3)
        row: dict[str, Any] = {"tokens": n, "payload_mb": nbytes / 1e6}
        row |= {k: statistics.median(v) for k, v in runs.items()}
        row["transfer_mb_per_s"] = nbytes / 1e6 / (row["transfer_ms"] / 1e3)
        out["sizes"].append(row)
    layers = src.model.config.num_hidden_layers
    pre = preempt_latency(src, args.preempt_tokens, reps=args.runs)
    out["preemption"] = {"prefill_tokens": args.preempt_tokens, "num_layers": layers} | pre
    return out


def run(args: argparse.Namespace) -> int:
    report = _bench(args)
    print(
        f"Migration on the torch engine ({report['model']}, {report['dtype']}, this CPU; "
        f"median of {args.runs} runs; data plane on loopback TCP):"
    )
    print("  tokens  payload MB  transfer ms  end-to-end ms  transfer MB/s")
    for r in report["sizes"]:
        print(
            f"  {r['tokens']:6d}  {r['payload_mb']:10.1f}  {r['transfer_ms']:11.1f}  "
            f"{r['end_to_end_ms']:13.1f}  {r['transfer_mb_per_s']:13.0f}"
        )
    p = report["preemption"]
    print(f"Layer-boundary preemption of a {p['prefill_tokens']}-token prefill: " + json.dumps(p))
    save_json(args.json, report)
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "migration",
        help="export + data plane + import of a request's KV on the torch engine, by size",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="model (default: the embedded SmolLM2)")
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1024, 4096, 8000],
        help="context lengths (SmolLM2 holds 8192 tokens)",
    )
    p.add_argument("--runs", type=int, default=3, help="runs per size (median)")
    p.add_argument("--preempt-tokens", type=int, default=2048, help="prefill cut by preemption")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's)")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
