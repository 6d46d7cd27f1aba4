"""Kill -9 one node of `tidal up --nats-cluster 3` in the middle of a batch and online streams,
and time how the node comes back (used by tests/fault/test_nats_cluster.py).

The node killed is the leader of the Batch API's jobs stream (the worst one to lose: its
followers must elect a new leader before a job is stored or acknowledged again). `tidal up`
restarts it; a watcher times the restart and then the node's catch-up: from its restart until
its `/healthz` answers 200, which NATS gives only once every JetStream asset on the node
(meta, streams, consumers) is current with the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.common.batch_store import JOBS_STREAM
from services.common.bus import connect
from tidal_bench.faults.kit import Outcome, Stack, run_mixed


async def jobs_leader(stack: Stack, timeout_s: float = 30.0) -> str:
    """The node leading the jobs stream (nats-1, nats-2, ...)."""
    deadline = time.monotonic() + timeout_s
    while not (stack.tmp / "up.json").exists():  # `tidal up` writes it once ready
        assert time.monotonic() < deadline, "tidal up wrote no state file"
        await asyncio.sleep(0.1)
    url = json.loads((stack.tmp / "up.json").read_text())["nats_url"]
    nc = await connect(url, "tidal-natsfault")
    try:
        while True:
            with contextlib.suppress(Exception):
                info = await nc.jetstream().stream_info(JOBS_STREAM)
                if info.cluster is not None and info.cluster.leader:
                    return str(info.cluster.leader)
            if time.monotonic() > deadline:
                raise AssertionError(f"{JOBS_STREAM} has no leader after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


@dataclass
class NodeReturn:
    node: str
    killed_pid: int
    down_at: float | None = None  # monotonic: the old process gone
    restarted_at: float | None = None  # a new process of the node seen
    current_at: float | None = None  # its /healthz answered 200

    @property
    def restart_s(self) -> float | None:
        if self.down_at is None or self.restarted_at is None:
            return None
        return self.restarted_at - self.down_at

    @property
    def catch_up_s(self) -> float | None:
        if self.restarted_at is None or self.current_at is None:
            return None
        return self.current_at - self.restarted_at


def _monitor_port(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"-m") + 1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def watch_node(stack: Stack, node: str, pid: int, timeout_s: float) -> NodeReturn:
    """Poll (every 20 ms) until `node`'s process `pid` is gone, a new one runs, and that one
    reports current; give up after `timeout_s`."""
    r = NodeReturn(node, pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and r.current_at is None:
        now = time.monotonic()
        if r.down_at is None:
            if not Path(f"/proc/{pid}").exists():
                r.down_at = now
        elif r.restarted_at is None:
            with contextlib.suppress(IndexError, ValueError):
                new_pid = stack.nats_pid(node)
                if new_pid != pid:
                    r.restarted_at, pid = now, new_pid
        else:
            with contextlib.suppress(OSError, ValueError):
                if _healthy(_monitor_port(pid)):
                    r.current_at = now
        time.sleep(0.02)
    return r


async def run_node_loss(
    stack: Stack, *, streams: int = 16, batch_lines: int = 200, timeout_s: float = 240.0
) -> tuple[Outcome, NodeReturn]:
    """`run_mixed` with the jobs stream's leader as the kill, and that node's return timed."""
    node = await jobs_leader(stack)
    pid = stack.nats_pid(node)
    result: list[NodeReturn] = []
    watcher = threading.Thread(
        target=lambda: result.append(watch_node(stack, node, pid, timeout_s)), daemon=True
    )
    watcher.start()
    outcome = await run_mixed(stack, node, streams=streams, batch_lines=batch_lines)
    await asyncio.to_thread(watcher.join, timeout_s)
    return outcome, result[0] if result else NodeReturn(node, pid)
