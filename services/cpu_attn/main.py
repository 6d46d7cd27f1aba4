"""A CPU-attention worker (OmniServe §3.2): registers and heartbeats with its capacity.

Taking offloaded best-effort decode attention is later work; today the worker joins the cluster so
the scheduler and operators see it and its resources.

    python -m services.cpu_attn --id cpu-attn-0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time

from services.common.bus import connect
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import run_service
from tidal import envs
from tidal.schemas import codec, subjects
from tidal.schemas.messages import Heartbeat

log = logging.getLogger("tidal.cpu_attn")


def _mem_total_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20
    return 0.0


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    subjects.check_token(args.id, "cpu_attn id")
    nc = await connect(args.nats_url, f"cpu_attn-{args.id}", args.connect_timeout_s)
    started = time.time()
    info = {
        "num_threads": str(args.num_threads or os.cpu_count() or 1),
        "mem_total_gib": f"{_mem_total_gib():.1f}",
        "offloaded_requests": "0",
        "state": "idle (attention offload not enabled in this build)",
    }

    def beat(status: str = "ok") -> Heartbeat:
        return Heartbeat(
            service_id=args.id,
            kind="cpu_attn",
            pid=os.getpid(),
            started_unix_s=started,
            sent_unix_s=time.time(),
            status=status,
            info=info,
        )

    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(nc.drain)
        log.info("cpu_attn %s ready (%s threads)", args.id, info["num_threads"])
        await heartbeat_loop(nc, beat, stop, envs.heartbeat_s())
        await nc.publish(subjects.heartbeat("cpu_attn", args.id), codec.encode(beat("stopped")))
    log.info("cpu_attn %s stopped", args.id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.cpu_attn", description=__doc__)
    p.add_argument("--nats-url", default=envs.NATS_URL.get(), help="NATS server to join")
    p.add_argument("--id", default="cpu-attn-0", help="worker id (letters, digits, _ -)")
    p.add_argument("--num-threads", type=int, default=0, help="attention threads (0: all)")
    p.add_argument("--connect-timeout-s", type=float, default=10.0, help="give up after this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("cpu_attn", lambda stop: serve(args, stop))
