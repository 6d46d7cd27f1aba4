"""`tidal bench faults`: how fast the stack recovers from kill -9 of each of its parts.

For each fault (the gateway, the scheduler, each instance, nats-server) and each repeat, a fresh
`tidal up --engine sim` (emulated timings) runs an offline batch through the Batch API and
`--streams` online streams (the openai client, `stream=True`); once every stream has its first
tokens, the part is killed with SIGKILL and `tidal up` restarts it. Measured from the kill:

- recovery: until a new one-token request succeeds (a prober retries every 50 ms);
- streams resume: until the last stream in flight gets its next token (a stream on a killed
  instance, or cut by the bus outage, runs again elsewhere from the tokens already streamed);
- client error: until the last client of a killed gateway sees its stream fail.

Also counted: streams that errored or hung, batch lines lost or duplicated in the output. Figures
are medians over `--repeats`, printed as a table and written as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from tidal_bench.kit import save_json

# The parts of a `tidal up` stack this benchmark kills, by their supervisor names.
KILLS = ("gateway-0", "scheduler-0", "instance-0", "instance-1", "nats-server")


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _one(kill: str, args: argparse.Namespace) -> dict[str, Any]:
    # NOTE: imported here: the fault kit needs `openai` (a dev dependency), and `tidal` must
    # start without it.
    from tidal_bench.faults.kit import Stack, run_mixed

    stack = Stack(step_model=args.sim_step_model, heartbeat_s=args.heartbeat_s)
    try:
        stack.wait_ready()
        o = asyncio.run(
            run_mixed(stack, kill, streams=args.streams, max_tokens=args.max_tokens,
                      batch_lines=args.batch_lines, batch_max_tokens=args.batch_max_tokens)
        )  # fmt: skip
    finally:
        stack.stop()
    return o.summary()


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def run(args: argparse.Namespace) -> int:
    kills = [k for k in args.kills.split(",") if k]
    unknown = sorted(set(kills) - set(KILLS))
    if unknown:
        raise SystemExit(f"--kills: unknown {unknown}; known: {','.join(KILLS)}")
    rows: dict[str, Any] = {}
    for kill in kills:
        runs = [_one(kill, args) for _ in range(args.repeats)]
        rows[kill] = {
            "recovery_s": _median([r["recovery_s"] for r in runs]),
            "resume_s": _median([r["resume_s"] for r in runs]),
            "error_s": _median([r["error_s"] for r in runs]),
            "streams_errored": sum(r["streams_errored"] for r in runs),
            "streams_lost": sum(r["streams_lost"] for r in runs),
            "streams_hung": sum(r["streams_hung"] for r in runs),
            "batch_lost": sum(r["batch_lost"] for r in runs),
            "batch_duplicated": sum(r["batch_duplicated"] for r in runs),
            "runs": runs,
        }
    print(
        f"Recovery from kill -9 under mixed load (sim engine, EMULATED timings, step model "
        f"{args.sim_step_model}, heartbeats every {args.heartbeat_s:g} s; {args.streams} "
        f"streams x {args.max_tokens} tokens + a "
        f"{args.batch_lines}-line batch; median of {args.repeats}, counts summed):"
    )
    print("  (recovery: to the first request served again; resume: to the last stream in flight "
          "going on; error: to the last client of the killed gateway seeing its error. Streams: "
          "errored / of them lost, i.e. not the killed gateway's own / hung. Batch lines: lost / "
          "duplicated.)")  # fmt: skip
    print(f"  {'fault':12s} {'recovery s':>10s} {'resume s':>9s} {'error s':>8s} "
          f"{'streams err/lost/hung':>22s} {'lines lost/dup':>15s}")  # fmt: skip
    for kill, r in rows.items():
        streams = f"{r['streams_errored']}/{r['streams_lost']}/{r['streams_hung']}"
        lines = f"{r['batch_lost']}/{r['batch_duplicated']}"
        print(f"  {kill:12s} {_fmt(r['recovery_s']):>10s} {_fmt(r['resume_s']):>9s} "
              f"{_fmt(r['error_s']):>8s} {streams:>22s} {lines:>15s}")  # fmt: skip
    save_json(args.json, {"what": "kill -9 recovery under mixed load", "emulated": True,
                          "args": args, "faults": rows})  # fmt: skip
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "faults",
        help="kill -9 each part under mixed load: recovery and stream resume times",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kills", default=",".join(KILLS), help="comma-separated parts to kill")
    p.add_argument("--repeats", type=int, default=3, help="fresh stacks per fault (median)")
    p.add_argument("--streams", type=int, default=32, help="concurrent online streams")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--batch-lines", type=int, default=200, help="lines of the offline batch")
    p.add_argument("--batch-max-tokens", type=int, default=32, help="tokens per batch line")
    p.add_argument("--sim-step-model", default="linear:0.004,0.002,0,0", help="emulated step time")
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=0.5,
        help="TIDAL_HEARTBEAT_S of the stack (default: the product's; a dead service is "
        "noticed after 4 missed)",
    )
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
