"""`tidal bench engine`: throughput of the real torch engine beside HF `transformers` and the
memory-bandwidth roofline.

    tidal bench engine [--json PATH] [--batches 1,8,32,64] [--prefill 512,2048] [--no-hf]
                       [--dtype float32|bfloat16] [--profile]
    tidal bench engine --device cuda --shape qwen2.5-7b     # random weights, Qwen2.5-7B's shape

Decode tokens/s at each batch size (prompts of --prompt-len tokens, --decode-steps timed steps),
prefill tokens/s at each prompt length (one chunk), each beside HF `generate` on the same model,
dtype and thread count, and beside the roofline: bytes one step reads (weights + KV) divided by the
read bandwidth of a large tensor, the median of three probes before the runs and three after each
dtype's (single probes swung 30-54 GB/s on a shared VM; the copy bandwidth is reported beside it).
Also the time from `request_layer_cut()` to the engine being free during a long prefill (OOCO
§3.4.1). Figures come from a real engine.

On CPU both fp32 and bf16 run, side by side (or only --dtype), and the report says which one the
engine picks by default here and why (`tidal.engine.torch.dtype_choice`: measured, not by CPU flag).
Where that choice is fp32 with bf16 weight copies for small-row matmuls (AVX2), it runs too, as
`auto` (`--dtype auto` alone, or in a comma list); its roofline counts the bytes each batch
reads (the bf16 copies where they serve). HF runs once per torch dtype: `auto` reuses fp32's.
--profile adds where a batch-1 decode step's time goes, per phase (`phases`).
On CPU the report also says what this CPU runs (`tidal.engine.torch.cpu_caps`): a CPU without
AVX-512 (or `TIDAL_CPU_ISA=avx2`) runs bf16 on plain matmuls, not oneDNN-packed ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

# NOTE: torch and the engine are imported in the functions that run: `tidal bench` registers
# this command's options for every bench command, and most of them need no torch.


def run_bench(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from tidal.engine.torch.dtype_choice import choose_dtype, weight_rows
    from tidal_bench.engine.measure import QWEN25_7B, copy_bandwidth, read_bandwidth

    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(x) for x in args.batches.split(",") if x]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    if args.dtype:
        dtypes = [d for d in args.dtype.split(",") if d]
    else:  # both, side by side: the figures behind the engine's own choice
        dtypes = ["bfloat16"] if device.type == "cuda" else ["float32", "bfloat16", "auto"]
    res: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads(), "runs": {}}
    if device.type == "cpu":
        from tidal.engine.torch import cpu_caps

        refusal = cpu_caps.pack_refusal(torch.bfloat16)
        res["cpu"] = {"caps": cpu_caps.probe().summary(), "bf16_packing": refusal or "on"}
    hf_dir = None
    if args.shape == "qwen2.5-7b":
        cfg = QWEN25_7B
    else:
        from tidal.engine.torch.weights import embedded_model_path, load_checkpoint

        path = embedded_model_path() if args.model is None else Path(args.model)
        cfg, _, _, hf_dir = load_checkpoint(path)
    steps = 2 + len(batches) + len(prefills)
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("dtype choice", total=1 + steps * len(dtypes))
        choice = choose_dtype(cfg, device)
        res["chosen"] = {
            "dtype": choice.dtype,
            "bf16_weight_rows": choice.bf16_weight_rows,
            "reason": choice.reason,
        }
        if "auto" in dtypes and not args.dtype and not weight_rows(choice):
            dtypes.remove("auto")  # the choice is one of the plain runs
        hf_seen: dict[str, dict[str, Any]] = {}  # torch dtype -> HF figures already measured
        prog.update(task, advance=1, description="memory bandwidth")
        res["copy_bandwidth_gb_s"] = copy_bandwidth(device) / 1e9
        reads = read_bandwidth(device)
        for dt in dtypes:
            res["runs"][dt] = _bench_dtype(
                args, cfg, dt, hf_dir, batches, prefills, prog, task, hf_seen
            )
            prog.update(task, description="memory bandwidth")
            reads += read_bandwidth(device)
        bw = statistics.median(reads)
        res["read_bandwidth_gb_s"] = bw / 1e9
        res["read_bandwidth_probes_gb_s"] = [round(r / 1e9, 2) for r in reads]
        for r in res["runs"].values():
            _add_roofline(r, bw)
    _report(console, res, batches, prefills)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _bench_dtype(
    args: argparse.Namespace,
    cfg: Any,
    dtype: str,
    hf_dir: Path | None,
    batches: list[int],
    prefills: list[int],
    prog: Any,
    task: Any,
    hf_seen: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Every figure of one dtype ("auto": the engine's own choice): ours, HF's (same torch
    dtype, threads; reused from `hf_seen` when that dtype's were measured), and the bytes each
    decode step reads, for the roofline (`_add_roofline`)."""
    import torch

    from tidal.engine.torch.loader import load_torch_engine
    from tidal_bench.engine.measure import (
        HFGenerate,
        engine_decode,
        engine_prefill,
        preempt_latency,
        random_engine,
        step_bytes,
    )
    from tidal_bench.engine.phases import profile_decode

    device = torch.device(args.device)
    prog.update(task, advance=1, description=f"{dtype}: loading")
    if hf_dir is None:
        engine = random_engine(cfg, device, getattr(torch, dtype))
    else:
        engine = load_torch_engine(
            args.model,
            device=args.device,
            dtype=None if dtype == "auto" else dtype,
            kv_cache_tokens=args.kv_tokens,
            max_num_seqs=256,
            token_budget=max([*prefills, 512]),
            chunk_size=max([*prefills, 512]),
        )
    dt = engine.model.dtype
    small = engine.model.small
    res: dict[str, Any] = {
        "model": engine.model_name,
        "dtype": str(dt).removeprefix("torch."),
        "bf16_weight_rows": 0 if small is None else small.max_rows,
    }
    hf = None
    seen = hf_seen.get(res["dtype"])
    if hf_dir is not None and not args.no_hf and seen is None:
        prog.update(task, description=f"{dtype}: loading HF transformers")
        hf = HFGenerate(hf_dir, dt, cfg.vocab_size)
    ctx = args.prompt_len + args.decode_steps // 2 + 2
    dec, hf_dec, step_ms, nbytes = {}, {}, {}, {}
    for b in batches:
        prog.update(task, advance=1, description=f"{dtype}: decode batch {b}")
        between = (
            None if hf is None else lambda b=b: hf.decode(b, args.prompt_len, args.decode_steps)
        )
        tps, hf_tps = engine_decode(
            engine, b, args.prompt_len, args.decode_steps, args.rounds, between
        )
        dec[str(b)] = tps
        step_ms[str(b)] = 1e3 * b / tps
        nbytes[str(b)] = step_bytes(engine, b, ctx)
        if hf_tps is not None:
            hf_dec[str(b)] = hf_tps
    pre, hf_pre = {}, {}
    for n in prefills:
        prog.update(task, advance=1, description=f"{dtype}: prefill {n}")
        engine_prefill(engine, n, run=99)  # warm-up
        pre[str(n)] = max(engine_prefill(engine, n, r) for r in range(args.rounds))
        if hf is not None:
            hf_pre[str(n)] = max(hf.prefill(n, r) for r in range(args.rounds))
    res |= {
        "decode_tokens_per_s": dec,
        "decode_step_ms": step_ms,
        "decode_step_bytes": nbytes,
        "prefill_tokens_per_s": pre,
        "hf": seen or {"decode": hf_dec, "prefill": hf_pre},
    }
    if hf is not None:
        hf_seen[res["dtype"]] = res["hf"]
    prog.update(task, advance=1, description=f"{dtype}: preemption latency")
    plen = min(max([*prefills, 512]), engine.max_model_len - 1)
    res["preemption"] = preempt_latency(engine, plen) | {"prefill_tokens": plen}
    if args.profile:
        prog.update(task, description=f"{dtype}: profiling a batch-1 decode step")
        res["profile_batch1"] = profile_decode(engine, 1, args.prompt_len)
    return res


def _add_roofline(r: dict[str, Any], bw: float) -> None:
    """Each decode batch's roofline at `bw` bytes/s, and the targets measured against it."""
    nbytes = r["decode_step_bytes"]
    r["roofline_decode_tokens_per_s"] = {b: int(b) / (n / bw) for b, n in nbytes.items()}
    r["roofline_decode_step_ms"] = {b: 1e3 * n / bw for b, n in nbytes.items()}
    r["targets"] = _targets(r)


def _targets(r: dict[str, Any]) -> dict[str, float]:
    d, hf = r["decode_tokens_per_s"], r["hf"]["decode"]
    checks = {}
    if "1" in d and "1" in hf:
        checks["batch1_vs_hf"] = d["1"] / hf["1"]
    if "1" in d:
        checks["batch1_pct_roofline"] = 100 * d["1"] / r["roofline_decode_tokens_per_s"]["1"]
    if "32" in d and "8" in hf:
        checks["batch32_vs_hf_batch8"] = d["32"] / hf["8"]
    return checks


GOALS = {"batch1_vs_hf": 1.2, "batch1_pct_roofline": 60.0, "batch32_vs_hf_batch8": 4.0}


def _report(console: Any, res: dict[str, Any], batches: list[int], prefills: list[int]) -> None:
    from rich.table import Table

    from tidal_bench.engine.phases import format_table

    runs = res["runs"]
    first = next(iter(runs.values()))
    t = Table(
        title=f"torch engine (real) — {first['model']} on {res['device']}, {res['threads']} "
        f"threads, read bandwidth {res['read_bandwidth_gb_s']:.1f} GB/s (median of "
        f"{', '.join(map(str, res['read_bandwidth_probes_gb_s']))}; copy "
        f"{res['copy_bandwidth_gb_s']:.1f})"
    )
    for c in ("dtype", "phase", "size", "tidal tok/s", "HF tok/s", "× HF", "roof tok/s", "% roof"):
        t.add_column(c, justify="right")

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}"

    for dt, r in runs.items():
        short = {"float32": "fp32", "bfloat16": "bf16"}.get(dt, dt)
        if r.get("bf16_weight_rows"):
            short = f"fp32+bf16≤{r['bf16_weight_rows']}"
        for b in batches:
            k = str(b)
            ours, theirs = r["decode_tokens_per_s"][k], r["hf"]["decode"].get(k)
            roof = r["roofline_decode_tokens_per_s"][k]
            ratio = "-" if theirs is None else f"{ours / theirs:.2f}"
            pct = f"{100 * ours / roof:.0f} %"
            t.add_row(short, "decode", f"b{b}", fmt(ours), fmt(theirs), ratio, fmt(roof), pct)
        for n in prefills:
            k = str(n)
            ours, theirs = r["prefill_tokens_per_s"][k], r["hf"]["prefill"].get(k)
            ratio = "-" if theirs is None else f"{ours / theirs:.2f}"
            t.add_row(short, "prefill", f"{n}", fmt(ours), fmt(theirs), ratio, "-", "-")
    console.print(t)
    for dt, r in runs.items():
        pm = r["preemption"]
        console.print(
            f"{dt}: preempt signal -> engine free {pm['preempt_to_free_ms']:.2f} ms (one layer "
            f"of a {pm['prefill_tokens']}-token prefill: {pm['layer_ms']:.2f} ms)"
        )
        for k, goal in GOALS.items():
            v = r["targets"].get(k)
            if v is not None:
                console.print(
                    f"{dt}: target {k}: {v:.2f} (goal >= {goal}) {'met' if v >= goal else 'MISSED'}"
                )
        if "profile_batch1" in r:
            console.print(f"{dt}: where a batch-1 decode step's time goes (torch.profiler)")
            console.print(format_table({dt: r["profile_batch1"]}), markup=False)
    if "cpu" in res:
        console.print(
            f"CPU: {res['cpu']['caps']}; oneDNN bf16 packing: {res['cpu']['bf16_packing']}",
            markup=False,
        )
    ch = res["chosen"]
    console.print(f"engine default dtype here: [bold]{ch['dtype']}[/] — {ch['reason']}")
    if {"float32", "bfloat16"} <= set(runs) and "1" in first["decode_tokens_per_s"]:
        b1 = {dt: runs[dt]["decode_tokens_per_s"]["1"] for dt in ("float32", "bfloat16")}
        best = max(b1, key=lambda dt: b1[dt])
        console.print(
            f"this run, batch 1: bf16 {b1['bfloat16']:.1f} vs fp32 {b1['float32']:.1f} tok/s "
            f"({'agrees with' if best == ch['dtype'] else 'differs from'} the choice)"
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
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 | auto, or a comma list (default: fp32, bf16, and auto"
        " where the choice splits by rows)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--prefill", default="512,2048", help="prefill lengths")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens before decode")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; best one counts")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--kv-tokens", type=int, default=64 * 256 + 8192, help="KV cache tokens")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument(
        "--profile", action="store_true", help="also a per-phase profile of a batch-1 decode step"
    )
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tidal bench engine", description=__doc__)
    _add_args(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
