"""`tidal bench checkpoint`: preemption cost of offline decodes with and without KV checkpoints
(ConServe), on the torch engine (measured, wall time on this machine) and in
the simulator (simulated: roofline step times, copies at --pcie-gb-per-s).

    tidal bench checkpoint [--requests 4] [--context 1024] [--decode 40] [--after 8]
                           [--model ""] [--sim-model qwen2.5-7b] [--sim-hardware a100-80gb]
                           [--skip-engine] [--steps-only] [--own] [--live] [--json PATH]

N offline requests with `--context`-token prompts decode `--decode` tokens, are preempted all at
once, resume, and decode `--after` more; four ways to preempt:
  recompute        drop the KV; prompt + output prefilled again on resume
  swap             all KV copied to host at the preemption, back on resume
  checkpoint       full blocks queued every decode step and copied to host in the background,
                   beside the step (engine: a worker thread); the preemption frees the blocks
                   with no copy; resume copies the checkpoint back and prefills the tail past
                   its last full block
  checkpoint-sync  the same, the copy done before the step, inside the plan's checkpoint stage
Per mode: the median, first (its checkpoint is the whole prompt's) and mean decode step before
the preemption, and the step overhead against `recompute` (no checkpoints: its decode steps are
the plain ones), the time spent copying checkpoints, the time from preemption to every block
free, from resume to every request decoding again, KV tokens recomputed, host bytes held, and
(engine) whether the greedy tokens equal an uninterrupted run. `--own`: the engines' own
eviction (no policy) with and without a checkpoint budget (`own.py`). `--live`: the same
preemption sent as the bus signal (`tidal.inst.<id>.preempt`) to a live torch instance
(`live.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from tidal_bench.checkpoint import engine as eng
from tidal_bench.checkpoint import sim
from tidal_bench.kit import save_json


def _rows(figs: list[Any], label: str) -> None:
    base = next(f for f in figs if f.mode == "recompute")  # no checkpoints: the plain steps
    for f in figs:
        eq = getattr(f, "equal_to_uninterrupted", None)
        same = "" if eq is None else f"  same tokens {'yes' if eq else 'NO'}"
        over = f.mean_step_ms - base.mean_step_ms
        print(
            f"  {f.mode:15s} decode step median {f.decode_step_ms:8.2f} / first "
            f"{f.first_step_ms:8.2f} / mean {f.mean_step_ms:8.2f} ms ({over:+7.2f} ms mean vs "
            f"none)  copying {f.copy_ms:8.2f} ms  free {f.free_ms:8.3f} ms  resume "
            f"{f.resume_ms:9.2f} ms  recomputed {f.tokens_recomputed:6d} tok  host "
            f"{f.host_bytes / 2**20:8.2f} MiB{same}  ({label})"
        )


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "context", "decode", "after"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    sc = eng.Scenario(args.requests, args.context, args.decode, args.after)
    report: dict[str, Any] = {"scenario": dataclasses.asdict(sc)}
    print(f"{sc.num_requests} offline requests, {sc.context}-token prompts, preempted after "
          f"{sc.decode} decoded tokens, {sc.after} more after resuming")  # fmt: skip
    base: Any = None
    ref: Any = None
    if not args.skip_engine:
        import torch

        from tidal.engine.torch.loader import load_torch_engine

        if args.threads:
            torch.set_num_threads(args.threads)
        base = load_torch_engine(args.model or None, device=args.device, dtype=args.dtype)
        load = os.getloadavg()[0]
        where = (
            f"torch engine, {base.model_name} {args.dtype} on {args.device}, "
            f"{torch.get_num_threads()} threads, load average {load:.1f} at start: measured"
        )
        print(where)
        ref = None if args.steps_only else eng.uninterrupted(base, sc)
        if args.steps_only:
            steps = _steps(base, sc)
            report["engine"] = {"where": where, "steps_side_by_side": steps}
            save_json(args.json, report)
            return 0
        rows = [eng.measure(base, sc, m, ref) for m in eng.MODES]
        _rows(rows, "measured")
        steps = _steps(base, sc)
        report["engine"] = {
            "where": where,
            "modes": [dataclasses.asdict(f) for f in rows],
            "steps_side_by_side": steps,
        }
    where = f"simulator, {args.sim_model} on {args.sim_hardware}, PCIe {args.pcie_gb_per_s} GB/s"
    print(where + ": simulated")
    srows = [
        sim.measure(sc, m, args.sim_model, args.sim_hardware, args.pcie_gb_per_s) for m in eng.MODES
    ]
    _rows(srows, "simulated")
    report["simulator"] = {"where": where, "modes": [dataclasses.asdict(s) for s in srows]}
    if args.own:
        report["own"] = _own(args, sc, base, ref)
    if args.live:
        report["live"] = _live(args, sc)
    save_json(args.json, report)
    return 0


def _steps(base: Any, sc: eng.Scenario) -> list[dict[str, Any]]:
    print("  decode steps side by side (three engines stepped in turn): measured")
    steps = eng.step_overhead(base, sc)
    none = steps[0]
    for f in steps:
        print(
            f"  {f.mode:15s} median {f.median_ms:8.2f} / first {f.first_ms:8.2f} / mean "
            f"{f.mean_ms:8.2f} ms ({f.mean_ms - none.mean_ms:+7.2f} ms, "
            f"{f.mean_ms / none.mean_ms - 1:+6.1%} vs none)  with the wait for its copies "
            f"{f.mean_with_wait_ms:8.2f} ms  copying {f.copy_ms:8.2f} ms  (measured)"
        )
    return [dataclasses.asdict(f) for f in steps]


def _own(args: argparse.Namespace, sc: eng.Scenario, base: Any, ref: Any) -> dict[str, Any]:
    """The engines' own eviction with and without a checkpoint budget (`own.py`)."""
    from tidal_bench.checkpoint import own

    out: dict[str, Any] = {}
    sides: list[tuple[str, str, Any]] = []
    if base is not None:
        sides.append(("torch", "measured", lambda c: own.measure_torch(base, sc, c, ref)))
    sim_of = lambda c: own.measure_sim(sc, c, args.sim_model, args.sim_hardware)  # noqa: E731
    sides.append(("sim", "emulated", sim_of))
    for name, label, measure in sides:
        print(f"{name} engine, its own eviction (an online prompt of half the KV pool): {label}")
        # each twice, in the order none, checkpoints, checkpoints, none: on a shared machine a
        # change of load shows as a gap between a mode's two runs
        figs = [measure(c) for c in (False, True, True, False)]
        for f in figs:
            eq = f.equal_to_uninterrupted
            same = "" if eq is None else f"  same tokens {'yes' if eq else 'NO'}"
            print(
                f"  {f.mode:10s} released {f.releases} recomputed {f.recomputes}  evict "
                f"{f.evict_ms:7.3f} ms  recomputed {f.tokens_recomputed:6d} tok  host peak "
                f"{f.host_bytes_peak / 2**20:8.2f} MiB  online first token "
                f"{f.online_ttft_ms:9.2f} ms  all finished {f.finish_s:8.3f} s{same}  ({label})"
            )
        out[name] = {"label": label, "modes": [dataclasses.asdict(f) for f in figs]}
    return out


def _live(args: argparse.Namespace, sc: eng.Scenario) -> dict[str, Any]:
    """The preempt signal on a live torch instance (`live.py`), with and without checkpoints."""
    import asyncio

    from tidal_bench.checkpoint import live

    where = f"live torch instance ({args.model or 'embedded SmolLM2'}, {args.threads} threads)"
    print(where + ": the preempt signal, measured")
    figs = asyncio.run(
        live.measure(
            args.model, sc.num_requests, sc.context, sc.decode, sc.after, args.threads, args.dtype
        )
    )
    for f in figs:
        print(
            f"  {f.mode:10s} {'/'.join(sorted(set(f.how)))}: free {f.free_ms:8.3f} ms "
            f"({f.boundary_ms:.1f} of it to the step boundary)  "
            f"{f.freed_blocks} blocks  recomputed {f.tokens_lost:6d} tok  "
            f"all finished {f.finish_s:7.2f} s after the signal"
        )
    return {"where": where, "modes": [dataclasses.asdict(f) for f in figs]}


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("checkpoint", help="preemption cost with and without KV checkpoints",
                         description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--requests", type=int, default=4, help="offline decodes preempted at once")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of each")
    p.add_argument("--decode", type=int, default=40, help="tokens decoded before the preemption")
    p.add_argument("--after", type=int, default=8, help="tokens decoded after resuming")
    p.add_argument("--model", default="", help="HF directory or GGUF (default: embedded SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the engine's dtype (greedy equality)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    p.add_argument("--skip-engine", action="store_true", help="the simulator only")
    p.add_argument(
        "--steps-only",
        action="store_true",
        help="only the torch engine's decode steps side by side (no, background, sync copies)",
    )
    p.add_argument(
        "--own",
        action="store_true",
        help="also the engines' own eviction (no policy) with and without a checkpoint budget",
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="also the preempt signal on a live torch instance over a local nats-server",
    )
    p.add_argument("--sim-model", default="qwen2.5-7b", help="catalogue model (simulator)")
    p.add_argument("--sim-hardware", default="a100-80gb", help="catalogue GPU (simulator)")
    p.add_argument("--pcie-gb-per-s", type=float, default=25.0, help="host copies (simulator)")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
