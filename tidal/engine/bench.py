"""`tidal bench engine`: throughput of the real torch engine beside HF `transformers` and the
memory-bandwidth roofline.

    tidal bench engine [--json PATH] [--batches 1,8,32,64] [--prefill 512,2048] [--no-hf]
    tidal bench engine --device cuda --shape qwen2.5-7b     # random weights, Qwen2.5-7B's shape

Decode tokens/s at each batch size (prompts of --prompt-len tokens, --decode-steps timed steps),
prefill tokens/s at each prompt length (one chunk), each beside HF `generate` on the same model,
dtype and thread count, and beside the roofline: bytes one step moves (weights + KV read) divided
by the copy bandwidth measured with a large torch copy. Also the time from `request_preempt()`
to the engine being free during a long prefill (OOCO §3.4.1). Figures come from a real engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from tidal.engine.bench_lib import (
    QWEN25_7B,
    HFGenerate,
    copy_bandwidth,
    engine_decode,
    engine_prefill,
    preempt_latency,
    random_engine,
    step_bytes,
)
from tidal.engine.torch_engine import default_dtype, load_torch_engine


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(x) for x in args.batches.split(",") if x]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    res: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads()}
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("loading", total=3 + len(batches) + len(prefills))
        if args.shape == "qwen2.5-7b":
            dt = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
            engine = random_engine(QWEN25_7B, device, dt)
            hf_dir = None
        else:
            engine = load_torch_engine(
                args.model,
                device=args.device,
                dtype=args.dtype,
                kv_cache_tokens=args.kv_tokens,
                max_num_seqs=256,
                token_budget=max([*prefills, 512]),
                chunk_size=max([*prefills, 512]),
            )
            from tidal.engine.weights import embedded_model_path, load_checkpoint

            path = embedded_model_path() if args.model is None else Path(args.model)
            hf_dir = load_checkpoint(path)[3]
        res["model"] = engine.model_name
        res["dtype"] = str(engine.model.dtype).removeprefix("torch.")
        prog.update(task, advance=1, description="copy bandwidth")
        bw = copy_bandwidth(device)
        res["copy_bandwidth_gb_s"] = bw / 1e9
        hf = None
        if hf_dir is not None and not args.no_hf:
            prog.update(task, description="loading HF transformers")
            hf = HFGenerate(hf_dir, engine.model.dtype, engine.model.config.vocab_size)
        ctx = args.prompt_len + args.decode_steps // 2 + 2
        dec, hf_dec, roof, step_ms = {}, {}, {}, {}
        for b in batches:
            prog.update(task, advance=1, description=f"decode batch {b}")
            between = (
                None if hf is None else lambda b=b: hf.decode(b, args.prompt_len, args.decode_steps)
            )
            tps, hf_tps = engine_decode(
                engine, b, args.prompt_len, args.decode_steps, args.rounds, between
            )
            dec[str(b)] = tps
            step_ms[str(b)] = 1e3 * b / tps
            roof[str(b)] = b / (step_bytes(engine, b, ctx) / bw)
            if hf_tps is not None:
                hf_dec[str(b)] = hf_tps
        pre, hf_pre = {}, {}
        for n in prefills:
            prog.update(task, advance=1, description=f"prefill {n}")
            engine_prefill(engine, n, run=99)  # warm-up
            pre[str(n)] = max(engine_prefill(engine, n, r) for r in range(args.rounds))
            if hf is not None:
                hf_pre[str(n)] = max(hf.prefill(n, r) for r in range(args.rounds))
        res |= {
            "decode_tokens_per_s": dec,
            "decode_step_ms": step_ms,
            "roofline_decode_tokens_per_s": roof,
            "prefill_tokens_per_s": pre,
            "roofline_decode_step_ms": {
                str(b): 1e3 * step_bytes(engine, b, ctx) / bw for b in batches
            },
        }
        if hf is not None:
            res["hf"] = {"decode": hf_dec, "prefill": hf_pre}
        prog.update(task, advance=1, description="preemption latency")
        res["preemption"] = preempt_latency(engine, max([*prefills, 512]))
    _report(console, res, batches, prefills)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _report(console: Any, res: dict[str, Any], batches: list[int], prefills: list[int]) -> None:
    from rich.table import Table

    hf = res.get("hf", {"decode": {}, "prefill": {}})
    t = Table(
        title=f"torch engine (real) — {res['model']} {res['dtype']} on {res['device']}, "
        f"{res['threads']} threads, copy bandwidth {res['copy_bandwidth_gb_s']:.1f} GB/s"
    )
    for c in ("phase", "size", "tidal tok/s", "HF tok/s", "× HF", "roofline tok/s", "% roofline"):
        t.add_column(c, justify="right")

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}"

    for b in batches:
        k = str(b)
        ours, theirs, roof = (
            res["decode_tokens_per_s"][k],
            hf["decode"].get(k),
            res["roofline_decode_tokens_per_s"][k],
        )
        t.add_row(
            "decode",
            f"batch {b}",
            fmt(ours),
            fmt(theirs),
            "-" if theirs is None else f"{ours / theirs:.2f}",
            fmt(roof),
            f"{100 * ours / roof:.0f} %",
        )
    for n in prefills:
        k = str(n)
        ours, theirs = res["prefill_tokens_per_s"][k], hf["prefill"].get(k)
        t.add_row(
            "prefill",
            f"{n} tokens",
            fmt(ours),
            fmt(theirs),
            "-" if theirs is None else f"{ours / theirs:.2f}",
            "-",
            "-",
        )
    console.print(t)
    pm = res["preemption"]
    console.print(
        f"preempt signal -> engine free: {pm['preempt_to_free_ms']:.2f} ms "
        f"(one layer of a {max([*prefills, 512])}-token prefill: {pm['layer_ms']:.2f} ms)"
    )
    d = res["decode_tokens_per_s"]
    checks = {}
    if "1" in d and "1" in hf["decode"]:
        checks["batch1_vs_hf"] = d["1"] / hf["decode"]["1"]
    if "1" in d:
        checks["batch1_pct_roofline"] = 100 * d["1"] / res["roofline_decode_tokens_per_s"]["1"]
    if "32" in d and "8" in hf["decode"]:
        checks["batch32_vs_hf_batch8"] = d["32"] / hf["decode"]["8"]
    res["targets"] = checks
    for k, v, goal in (
        ("batch1_vs_hf", checks.get("batch1_vs_hf"), 1.2),
        ("batch1_pct_roofline", checks.get("batch1_pct_roofline"), 70.0),
        ("batch32_vs_hf_batch8", checks.get("batch32_vs_hf_batch8"), 4.0),
    ):
        if v is not None:
            console.print(
                f"target {k}: {v:.2f} (goal >= {goal}) {'met' if v >= goal else 'MISSED'}"
            )


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--shape",
        default="",
        choices=["", "qwen2.5-7b"],
        help="random weights of this shape instead of --model (no HF comparison)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: auto)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--prefill", default="512,2048", help="prefill lengths")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens before decode")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; best one counts")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--kv-tokens", type=int, default=64 * 256 + 8192, help="KV cache tokens")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run_bench)


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `engine` under an existing `tidal bench` parser."""
    p = bench_subparsers.add_parser(
        "engine",
        help="torch engine throughput vs HF and roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_args(p)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Standalone: add `bench engine` (when no other module owns `bench`)."""
    p = subparsers.add_parser("bench", help="benchmarks")
    register_bench(p.add_subparsers(dest="bench_cmd", required=True))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tidal bench engine", description=__doc__)
    _add_args(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
