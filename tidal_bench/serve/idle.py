"""`tidal bench idle`: what the control plane costs, per process, idle and beside a lone stream.

Starts `tidal up` (sim engine by default: the figures are the services' own CPU, the step times
are emulated) and reads each of its processes' CPU time from /proc over a window: first with
nothing to do, then while one streamed request runs. Prints each process's share of one core.
A quiet control plane costs near nothing idle, and little beside the instance that runs the
stream (issue 38).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
import urllib.request

from tidal_bench.kit import CpuClock, children_of, save_json, stack, up_pid


def cpu_shares(procs: dict[str, int], seconds: float) -> dict[str, float]:
    """name -> % of one core each of `procs` (name -> pid) used over the next `seconds`, most
    first."""
    clock = CpuClock(procs)
    time.sleep(seconds)
    got = clock.read()
    window_s = max(got["window_s"], 1e-9)
    shares = {name: 100 * cpu_s / window_s for name, cpu_s in got["cpu_s"].items()}
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def _stream(base: str, model: str, max_tokens: int) -> None:
    body = {"model": model, "prompt": "tide moon sea", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        base + "/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=600) as r:
        for _ in r:
            pass


def run(args: argparse.Namespace) -> int:
    up_args = ["--engine", args.engine, "--cpu-attn", str(args.cpu_attn)]
    with stack(args.port, *up_args) as base:
        with urllib.request.urlopen(base + "/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        time.sleep(args.settle_s)
        up = up_pid(args.port)
        procs = {**children_of(up), "tidal up": up}
        idle = cpu_shares(procs, args.seconds)
        t = threading.Thread(target=_stream, args=(base, model, args.max_tokens), daemon=True)
        t.start()
        time.sleep(2.0)  # past its prefill
        streaming = cpu_shares(procs, args.seconds)
    emulated = " (sim engine: emulated step times)" if args.engine == "sim" else ""
    print(f"% of one core per process, {args.seconds:.0f} s windows{emulated}")
    print(f"{'process':16s} {'idle':>8s} {'lone stream':>12s}")
    for name in streaming:
        print(f"{name:16s} {idle.get(name, 0.0):7.2f}% {streaming[name]:11.2f}%")
    print(f"{'total':16s} {sum(idle.values()):7.2f}% {sum(streaming.values()):11.2f}%")
    if args.json:
        save_json(args.json, {"engine": args.engine, "seconds": args.seconds, "idle": idle,
                              "lone_stream": streaming})  # fmt: skip
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "idle",
        help="the control plane's CPU per process, idle and beside a lone stream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", default="sim", choices=("sim", "torch"))
    p.add_argument("--cpu-attn", type=int, default=1, help="CPU-attention workers")
    p.add_argument("--port", type=int, default=8199)
    p.add_argument("--seconds", type=float, default=20.0, help="each window")
    p.add_argument("--settle-s", type=float, default=5.0, help="wait after start-up")
    p.add_argument("--max-tokens", type=int, default=4000, help="the lone stream's length")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
