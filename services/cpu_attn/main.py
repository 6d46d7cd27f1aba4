"""A CPU-attention worker (OmniServe §3.2, §4): holds offloaded requests' KV in host memory and
computes their decode attention for the instances, over its own TCP data plane
(`services.cpu_attn.server`); on NATS it only heartbeats, with its data-plane address (instances
find it there) and what it holds, for `tidal ctl status` and the gateway's `/metrics`.

    python -m services.cpu_attn --id cpu-attn-0 [--port 0] [--capacity-gib 8] [--num-threads 2]
        [--cores 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time

import torch

from services.common import affinity, net
from services.common.args import add_advertise_host, add_bus_args, add_listen_host
from services.common.bus import connect
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import run_service
from services.cpu_attn.server import AttnServer
from tidal import envs
from tidal.cpu_attn.kv_store import KvStore
from tidal.schemas import codec, subjects
from tidal.schemas.messages import Heartbeat

log = logging.getLogger("tidal.cpu_attn")


def _mem_total_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20
    return 0.0


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    subjects.check_token(args.id, "cpu_attn id")
    if args.capacity_gib <= 0:
        raise SystemExit("--capacity-gib must be > 0")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    store = KvStore(int(args.capacity_gib * 2**30))
    server = AttnServer(store)
    bind = args.host or net.default_bind_host(args.nats_url)
    await server.start(bind, args.port)
    nc = await connect(args.nats_url, f"cpu_attn-{args.id}", args.connect_timeout_s)
    started = time.time()
    advertise = net.resolve_advertise_host(bind, args.advertise_host, args.nats_url)

    def beat(status: str = "ok") -> Heartbeat:
        st = store.stats()
        t = server.timer
        info = {
            "data_addr": f"{advertise}:{server.port}",
            "num_threads": str(torch.get_num_threads()),
            "cores": affinity.format_cores(affinity.allowed_cores()),
            "mem_total_gib": f"{_mem_total_gib():.1f}",
            "capacity_bytes": str(st.capacity_bytes),
            "used_bytes": str(st.used_bytes),
            "offloaded_requests": str(st.num_requests),
            "kv_tokens": str(st.kv_tokens),
            "offloads_total": str(st.num_offloads),
            "recalls_total": str(st.num_recalls),
            "refused_total": str(st.num_refused),
            "connections": str(server.num_connections),
            "attn_rows_total": str(server.num_rows),
            "attn_ctx_tokens_total": str(server.num_ctx_tokens),
            "layer_seconds_sum": f"{t.total_s:.6f}",
            "layer_seconds_count": str(t.num),
            "layer_seconds_buckets": ",".join(str(c) for c in t.counts),
            "attn_ms_per_layer": f"{1e3 * t.total_s / t.num:.3f}" if t.num else "",
        }
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
        stack.push_async_callback(server.close)
        stack.push_async_callback(nc.drain)
        log.info(
            "cpu_attn %s ready: data plane %s:%d, %.1f GiB for KV, %d threads on cores %s",
            args.id,
            advertise,
            server.port,
            args.capacity_gib,
            torch.get_num_threads(),
            affinity.format_cores(affinity.allowed_cores()),
        )
        await heartbeat_loop(nc, beat, stop, envs.heartbeat_s())
        await nc.publish(subjects.heartbeat("cpu_attn", args.id), codec.encode(beat("stopped")))
    log.info("cpu_attn %s stopped", args.id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.cpu_attn", description=__doc__)
    add_bus_args(p)
    p.add_argument("--id", default="cpu-attn-0", help="worker id (letters, digits, _ -)")
    p.add_argument("--num-threads", type=int, default=0, help="attention threads (0: all)")
    p.add_argument(
        "--cores",
        default="",
        help="pin this worker to these cores (0 or 0-3,6) with one attention thread each, or "
        "--num-threads (default: unpinned)",
    )
    add_listen_host(p, "the worker's data plane listens", "--host")
    p.add_argument("--port", type=int, default=0, help="data-plane port (0: any free one)")
    add_advertise_host(p)
    p.add_argument(
        "--capacity-gib", type=float, default=4.0, help="host memory for offloaded KV, GiB"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        affinity.apply_spec(args.cores, args.num_threads)
    except ValueError as exc:
        print(f"cpu_attn: {exc}", file=sys.stderr)
        return 2
    return run_service("cpu_attn", lambda stop: serve(args, stop))
