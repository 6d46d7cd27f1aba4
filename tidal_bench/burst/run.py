"""`tidal bench burst`: the mission's premise, measured. Online traffic swings between bursts
and troughs (`--high-rate` then `--low-rate` req/s, `--phase-s` each, `--cycles` times) while
`--jobs` Batch API jobs of `--lines` lines, all submitted at the start, run beside it (llm-d's
batch-gateway benchmark design, llm-d #491).

For each policy: live, a fresh `tidal up --engine sim --config CONFIG --policy P` (the sim
engine takes each step's time from the simulator's latency model for the config's
MODEL@HARDWARE, with the simulator's KV pool, no CPU-attention worker), or the stack at `--url`;
the online requests are streamed `/v1/completions` calls of the official openai client at the
schedule's Poisson arrival times (or, with `--client guidellm`, guidellm's trace replay of the
same arrivals: guidellm's rate profiles run one rate each and cannot swing), the jobs go
through the openai client's Batch API and are polled every second. Then the simulator runs the
same arrivals and lines with the same config and policy. Printed per policy and phase: online
TTFT and ITL (each request's mean inter-token gap) p50/p99, 429 / 5xx / other errors; per job,
its completion time and lines without a result. Both sides are emulation (the sim engine, the
simulator), and are labelled so.

    tidal bench burst --policies online-priority ooco tidal --json out/burst.json \
        --plot out/burst.png
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from services.cli import natsd
from tidal.config.cluster import ClusterConfig, load_config
from tidal_bench.burst.live import run_live
from tidal_bench.burst.report import LABELS, markdown, plot, print_policy, side_report
from tidal_bench.burst.schedule import BurstSchedule
from tidal_bench.burst.simulated import kv_tokens_per_instance, run_simulated, sim_config
from tidal_bench.kit import save_json, stack

SIDES = ("live", "simulated")
CLIENTS = {"openai": "the openai client", "guidellm": "guidellm's trace replay"}


def schedule_of(args: argparse.Namespace) -> BurstSchedule:
    return BurstSchedule(
        high_rate=args.high_rate,
        low_rate=args.low_rate,
        phase_s=args.phase_s,
        cycles=args.cycles,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        jobs=args.jobs,
        lines=args.lines,
        line_prompt_tokens=args.line_prompt_tokens,
        line_output_tokens=args.line_output_tokens,
    )


def up_args(cfg: ClusterConfig, config_path: str, policy: str, sched: BurstSchedule) -> list[str]:
    """`tidal up` options that give the live stack the simulator's cluster for `policy`."""
    max_len = max(
        sched.prompt_tokens + sched.output_tokens,
        sched.line_prompt_tokens + sched.line_output_tokens,
    )
    return [
        "--engine", "sim", "--config", config_path, "--policy", policy, "--cpu-attn", "0",
        "--sim-step-model", cfg.step_model_spec(),
        "--kv-cache-tokens", str(kv_tokens_per_instance(cfg, policy)),
        "--max-model-len", str(max_len + 16),
        "--batch-max-inflight", str(cfg.batch_max_inflight),
    ]  # fmt: skip


def _live(
    args: argparse.Namespace, cfg: ClusterConfig, policy: str, sched: BurstSchedule, bar: Any
) -> dict[str, Any]:
    task = bar.add_task(f"{policy} live", total=sched.duration_s)

    def tick(t: float) -> None:
        bar.update(task, completed=min(t, sched.duration_s))

    gl = (args.guidellm_exe, cfg) if args.guidellm_exe else None

    def go(base: str) -> dict[str, Any]:
        return asyncio.run(
            run_live(base, sched, args.seed, args.job_timeout_s, tick=tick, guidellm=gl)
        )

    if args.url:
        return go(args.url.rstrip("/"))
    env = {"TIDAL_SIM_KV_PAYLOAD_BYTES_PER_TOKEN": str(args.kv_payload_bytes_per_token)}
    with stack(natsd.free_port(), *up_args(cfg, args.config, policy, sched), env=env) as base:
        return go(base)


def run_all(args: argparse.Namespace, sched: BurstSchedule) -> dict[str, Any]:
    """Every policy's live and simulated sides, as the JSON report."""
    from rich.progress import Progress

    cfg = sim_config(load_config(args.config), sched, args.job_timeout_s)
    runs: dict[str, dict[str, Any]] = {}
    end = sched.duration_s + args.job_timeout_s  # the simulator's horizon
    with Progress(transient=True) as bar:
        for policy in args.policies:
            runs[policy] = {}
            offset = 0.0  # the simulator's online arrivals start as late as the live ones did
            if "live" in args.sides:
                raw = _live(args, cfg, policy, sched, bar)
                runs[policy]["live"] = side_report(sched, "live", raw)
                offset = raw["online_offset_s"]
            if "simulated" in args.sides:
                task = bar.add_task(f"{policy} simulated", total=end)

                def tick(t: float, task: Any = task) -> None:
                    bar.update(task, completed=min(t, end))

                raw = run_simulated(cfg, policy, sched, args.seed, args.job_timeout_s, tick, offset)
                runs[policy]["simulated"] = side_report(sched, "simulated", raw)
    return {
        "what": "online burst/trough swing beside Batch API jobs; "
        + "; ".join(LABELS[s] for s in args.sides),
        "config": args.config,
        "online_client": args.client,
        "schedule": vars(sched),
        "phases": sched.phases(),
        "seed": args.seed,
        "runs": runs,
    }


def run(args: argparse.Namespace) -> int:
    try:
        sched = schedule_of(args)
        args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
        bad = [s for s in args.sides if s not in SIDES]
        if bad or not args.sides:
            raise ValueError(f"--sides takes live and/or simulated, got {bad or 'nothing'}")
        if args.url and len(args.policies) != 1:
            raise ValueError(
                "--url measures one running stack: give the one policy it runs (--policies P)"
            )
        if args.job_timeout_s <= 0:
            raise ValueError(f"--job-timeout-s must be > 0, got {args.job_timeout_s}")
        args.guidellm_exe = ""
        if args.client == "guidellm" and "live" in args.sides:
            from tidal_bench.replay import guidellm as gl

            try:
                args.guidellm_exe = gl.find_guidellm(args.guidellm)
            except gl.GuidellmError as e:
                raise ValueError(str(e)) from None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = run_all(args, sched)
    print(
        f"Online swing {sched.high_rate:g}/s <-> {sched.low_rate:g}/s, {sched.phase_s:g} s "
        f"phases x {sched.cycles} cycles ({sched.prompt_tokens} in / {sched.output_tokens} out "
        f"tokens), beside {sched.jobs} Batch API job(s) of {sched.lines} lines "
        f"({sched.line_prompt_tokens} in / {sched.line_output_tokens} out); config "
        f"{args.config}; "
        + (f"online load from {CLIENTS[args.client]}; " if "live" in args.sides else "")
        + "sides: "
        + "; ".join(LABELS[s] for s in args.sides)
        + ":"
    )
    for policy, sides in report["runs"].items():
        print_policy(policy, sides)
    save_json(args.json, report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report) + "\n")
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    lost = any(not s["all_lines_done"] for sides in report["runs"].values() for s in sides.values())
    return 1 if lost else 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "burst",
        help="online bursts and troughs beside Batch API jobs, per policy, live and simulated",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--policies", nargs="+", default=["online-priority", "ooco", "tidal"], help="policies"
    )
    p.add_argument("--config", default="configs/ooco.yaml", help="cluster config YAML")
    p.add_argument("--url", default="", help="a running stack's API URL (default: start one)")
    p.add_argument("--sides", default="live,simulated", help="live and/or simulated")
    p.add_argument("--high-rate", type=float, default=4.0, help="online req/s in a burst")
    p.add_argument("--low-rate", type=float, default=1.0, help="online req/s in a trough")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds of each burst/trough")
    p.add_argument("--cycles", type=int, default=3, help="burst + trough pairs")
    p.add_argument("--prompt-tokens", type=int, default=256, help="online prompt tokens")
    p.add_argument("--output-tokens", type=int, default=64, help="online output tokens")
    p.add_argument("--jobs", type=int, default=3, help="Batch API jobs submitted at the start")
    p.add_argument("--lines", type=int, default=200, help="lines per job")
    p.add_argument("--line-prompt-tokens", type=int, default=1024, help="each line's prompt")
    p.add_argument("--line-output-tokens", type=int, default=1024, help="each line's output")
    p.add_argument(
        "--job-timeout-s",
        type=float,
        default=900.0,
        help="after the schedule, how long the jobs may still run (then cancelled)",
    )
    p.add_argument(
        "--kv-payload-bytes-per-token",
        type=int,
        default=-1,
        help="emulated KV bytes a live migration ships per token (-1: the emulated model's)",
    )
    p.add_argument(
        "--client",
        choices=tuple(CLIENTS),
        default="openai",
        help="who sends the live online load: Tidal's openai-client driver, or guidellm's trace "
        "replay (an outside client; the jobs always go through the openai client's Batch API)",
    )
    p.add_argument(
        "--guidellm", default="", help="guidellm executable (default: `guidellm` on PATH)"
    )
    p.add_argument("--seed", type=int, default=0, help="online arrivals")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.add_argument("--markdown", default="", help="also write the table here as markdown")
    p.add_argument("--plot", default="", help="write the plot here (PNG)")
    p.set_defaults(func=run)
