"""`tidal bench dataplane`: what the KV data plane moves, and what it costs the event loop.

For each size, one request's KV (a 7B model's 57,344 bytes per token by default) streams from
this process to a receiver in a child process over loopback TCP, exactly as a migration does
(`services.instance.dataplane`: framed 4 MiB chunks, CRC32C each, written into the receiver's
sink). Printed per size: GB/s, the receiver's peak resident memory (VmHWM, which must not grow
with the size: the plane holds a few frames, never the payload), and this process's event-loop
lag during the transfer (p50/p99/max of a 10 ms probe; the send runs on threads, the loop only
waits). `--kv sim` checks every byte against the request's emulated KV as the sim engine does;
`--kv raw` only counts them (the link and framing alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tidal_bench.kit import pct, save_json

SIZES = ("64M", "256M", "1G", "4G")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 256M or 4G")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def _peak_rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def serve(kv: str) -> None:
    """The child: a data plane whose sinks check (sim) or count (raw) every byte."""
    from services.instance.dataplane import DataPlaneServer
    from tidal.engine.sim.migrate import SimKvSink
    from tidal.engine.sim.seq import kv_digest
    from tidal.schemas.kv_wire import Hello

    class Sink:
        def __init__(self, hello: Hello) -> None:
            self.req_id, self.num_tokens = hello.ticket, hello.num_tokens
            self.bytes_per_token = hello.bytes_per_token

        def write(self, start: int, data: Any) -> None:
            pass

    class Receiver:
        def open_transfer(self, hello: Hello, state: bytes) -> Any:
            if kv == "raw":
                return Sink(hello)
            n = hello.num_tokens
            return SimKvSink(hello.ticket, n, hello.bytes_per_token, kv_digest([7], n))

        def end_transfer(self, ticket: str, error: str) -> None:
            print(json.dumps({"ticket": ticket, "error": error}), flush=True)

    async def main() -> None:
        plane = DataPlaneServer(Receiver())
        print(json.dumps({"url": await plane.start()}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def _send(url: str, ticket: str, nbytes: int, bpt: int) -> dict[str, float]:
    from services.instance.dataplane import send_kv
    from tidal.engine.sim.migrate import SimKvSource
    from tidal.engine.sim.seq import kv_digest

    n = -(-nbytes // bpt)
    source = SimKvSource(ticket, b"bench", n, bpt, kv_digest([7], n))
    lags: list[float] = []
    task = asyncio.ensure_future(send_kv(url, ticket, source))
    while not task.done():
        t0 = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append(max(0.0, time.perf_counter() - t0 - 0.01))
    secs = await task
    lags_ms = [1e3 * x for x in lags or [0.0]]
    return {
        "bytes": n * bpt,
        "seconds": secs,
        "gb_per_s": n * bpt / secs / 1e9,
        "lag_p50_ms": pct(lags_ms, 50),
        "lag_p99_ms": pct(lags_ms, 99),
        "lag_max_ms": max(lags_ms),
    }


def run(args: argparse.Namespace) -> int:
    if args.serve:
        serve(args.kv)
        return 0
    cmd = [sys.executable, "-m", "tidal_bench.dataplane.run", "--serve", "--kv", args.kv]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        url = json.loads(child.stdout.readline())["url"]
        base_rss = _peak_rss(child.pid)
        rows = []
        for i, size in enumerate(args.sizes):
            row = asyncio.run(_send(url, f"t{i}", parse_size(size), args.bytes_per_token))
            done = json.loads(child.stdout.readline())
            if done["error"]:
                raise SystemExit(f"{size}: the transfer failed: {done['error']}")
            row |= {"size": size, "receiver_peak_rss_mb": _peak_rss(child.pid) / 2**20}
            rows.append(row)
    finally:
        child.kill()
    print(
        f"KV data plane on loopback TCP, {args.bytes_per_token} KV bytes/token, --kv {args.kv} "
        f"(receiver in its own process; its peak RSS before any transfer: {base_rss / 2**20:.0f}"
        " MB):"
    )
    print("  size    GB/s   receiver peak RSS MB   loop lag p50 / p99 / max ms")
    for r in rows:
        print(
            f"  {r['size']:>5}  {r['gb_per_s']:5.2f}   {r['receiver_peak_rss_mb']:20.0f}   "
            f"{r['lag_p50_ms']:5.1f} / {r['lag_p99_ms']:5.1f} / {r['lag_max_ms']:6.1f}"
        )
    if args.json:
        save_json(args.json, {"kv": args.kv, "bytes_per_token": args.bytes_per_token, "rows": rows})
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "dataplane",
        help="KV data plane GB/s, receiver memory and event-loop lag, 64 MB to 4 GB",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help="payload sizes (64M ... 4G)")
    p.add_argument("--bytes-per-token", type=int, default=57_344, help="KV bytes per token")
    p.add_argument("--kv", choices=("sim", "raw"), default="sim", help="check or only count")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    sys.exit(run(parser.parse_args(["dataplane", *sys.argv[1:]])))
