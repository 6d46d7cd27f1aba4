"""A NATS node's host lost, and partitioned, under load: NATS a 3-node JetStream cluster spread
over the hosts (one node each, R=3 streams, services given all three seeds;
tests/cluster/conftest.py `nats_spread_cluster`). Each case checks every batch line exactly
once and every stream complete or ended by one clear error, and records its seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import urllib.request

import nats
import pytest

from services.common.batch_store import JOBS_STREAM
from tests.cluster.conftest import NATS_MONITOR_PORT, Cluster
from tests.cluster.kit import (
    RESULTS,
    BusLog,
    Stream,
    batch_output,
    client_for,
    once_each,
    stream,
    submit_batch,
    until_served,
)

pytestmark = [pytest.mark.cluster, pytest.mark.nats]
HOSTS = "3 (h0: nats-1+scheduler+batch+gateway, h1: nats-2+relaxed, h2: nats-3+strict; R=3)"


def node_log(c: Cluster, node: int) -> str:
    """The tail of nats-`node`'s own log (under its store)."""
    path = c.tmp / f"nats-{node}" / "nats-server.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def healthz_inside(c: Cluster, host: int) -> str:
    """The host's NATS node's /healthz, asked from inside the host (reachable while cut)."""
    url = f"http://127.0.0.1:{NATS_MONITOR_PORT}/healthz"
    argv = c.hosts.argv(host, "curl", "-s", "-m", "3", "-w", " %{http_code}", url)
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()


async def jobs_leader(bus: BusLog) -> str:
    """The NATS node leading the Batch API's jobs stream ("?" when none is known yet)."""
    assert bus.nc is not None
    with contextlib.suppress(Exception):
        info = await bus.nc.jetstream().stream_info(JOBS_STREAM)
        if info.cluster is not None and info.cluster.leader:
            return str(info.cluster.leader)
    return "?"


async def move_jobs_leader(bus: BusLog, node: str, timeout_s: float = 20.0) -> None:
    """Make `node` lead the jobs stream (leader step-down, `node` preferred): losing the leader
    is the worst case, its followers must elect another before a job is stored again."""
    assert bus.nc is not None
    subject = f"$JS.API.STREAM.LEADER.STEPDOWN.{JOBS_STREAM}"
    payload = json.dumps({"placement": {"preferred": node}}).encode()
    deadline = time.monotonic() + timeout_s
    while (leader := await jobs_leader(bus)) != node:
        assert time.monotonic() < deadline, f"{JOBS_STREAM} led by {leader}, not {node}"
        if leader != "?":
            with contextlib.suppress(Exception):
                await bus.nc.request(subject, payload, timeout=3)
        await asyncio.sleep(0.5)


async def move_meta_leader_off(c: Cluster, host: int, timeout_s: float = 30.0) -> None:
    """Keep host `host`'s node from leading JetStream's meta group (a cut meta leader calls
    itself leader, /healthz 200, until its lost-quorum timer, about as long as the cut). The
    meta step-down API is the system account's; restarting the node moves the leadership."""
    node = f"nats-{host + 1}"
    deadline = time.monotonic() + timeout_s
    while (leader := meta_leader(c)) == "?":
        assert time.monotonic() < deadline, "no meta leader"
        await asyncio.sleep(0.2)
    if leader != node:
        return
    c.procs[node].send_signal(signal.SIGKILL)
    c.procs[node].wait(timeout=5)
    while meta_leader(c) in (node, "?"):
        assert time.monotonic() < deadline, f"meta group still led by {node}"
        await asyncio.sleep(0.2)
    c.start(node, host, *c.nats_argv[node])
    assert c.nats_current(host, 30), node_log(c, host + 1)


def meta_leader(c: Cluster) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = f"http://{c.hosts.addrs[0]}:{NATS_MONITOR_PORT}/jsz"
    try:
        with opener.open(url, timeout=2) as resp:
            return str(json.loads(resp.read())["meta_cluster"].get("leader") or "?")
    except (OSError, ValueError, KeyError):
        return "?"


def check_streams(done: list[Stream], num_tokens: int) -> int:
    """Each stream complete (no repeated or missing token) or ended by one clear error; returns
    how many ended with an error."""
    for s in done:
        if not s.error:
            assert s.finish_reason == "length" and len(s.text.split()) == num_tokens, s
    return sum(bool(s.error) for s in done)


def first_error(done: list[Stream]) -> str:
    errors = [s.error for s in done if s.error]
    return f" (first: {errors[0][:100]})" if errors else ""


async def test_a_nats_node_host_lost_under_load(nats_spread_cluster: Cluster) -> None:
    c = nats_spread_cluster
    bus = await BusLog().start(c.nats_url)
    client = client_for(c.api)
    try:
        await move_jobs_leader(bus, "nats-3")
        batch_id = await submit_batch(client, 40, 64)
        streams = [
            asyncio.create_task(stream(client, f"chat, node lost {i}", 150)) for i in range(8)
        ]
        await asyncio.sleep(1.5)  # streams under way, batch lines running
        leader = await jobs_leader(bus)
        c.procs["nats-3"].send_signal(signal.SIGKILL)  # h2's node (`ip netns exec` execs it)
        c.procs["nats-3"].wait(timeout=5)
        t_kill = time.monotonic()
        recovery_s = await until_served(client, 60)
        for i in range(4):  # new online requests keep being served
            after = await stream(client, f"after the node loss {i}", 16)
            assert not after.error and after.finish_reason == "length", after
        done = await asyncio.gather(*streams)
        lines = await batch_output(client, batch_id, 150)
        lost, dup = once_each(lines, 40)
        assert (lost, dup) == (0, 0)
        num_errors = check_streams(done, 150)
        # The node comes back on the same store and catches up with the cluster.
        c.start("nats-3", 2, *c.nats_argv["nats-3"])
        t_restart = time.monotonic()
        assert c.nats_current(2, 30), node_log(c, 3)
        catch_up_s = time.monotonic() - t_restart
        served_s = time.monotonic() - t_kill
    finally:
        await bus.close()
    RESULTS.append(
        {
            "case": "NATS node host lost: kill -9 nats-3 (h2) under load",
            "hosts": HOSTS,
            "load": "8 streams x 150 tok + batch 40 x 64 tok",
            "lost": lost,
            "duplicated": dup,
            "recovery_s": f"{recovery_s:.1f}",
            "note": f"first new online request served {recovery_s:.1f} s after the kill; "
            f"jobs stream leader was {leader}; {num_errors} of 8 streams ended with a clear "
            f"error{first_error(done)}; restarted nats-3 current (/healthz) in {catch_up_s:.1f} s; "
            f"all checked {served_s:.0f} s after",
        }
    )


async def test_a_nats_node_partitioned_10_s(nats_spread_cluster: Cluster) -> None:
    c = nats_spread_cluster
    bus = await BusLog().start(c.nats_url)
    client = client_for(c.api)
    try:
        await move_meta_leader_off(c, 2)
        await move_jobs_leader(bus, "nats-3")
        batch_id = await submit_batch(client, 40, 64)
        streams = [
            asyncio.create_task(stream(client, f"chat, node cut {i}", 120)) for i in range(8)
        ]
        await asyncio.sleep(1.5)
        leader = await jobs_leader(bus)
        c.hosts.cut(2)  # h2: nats-3 and the strict instance
        await asyncio.sleep(10)
        during = healthz_inside(c, 2)  # what nats-3 says of itself, cut off
        assert not during.endswith(" 200"), f"nats-3 did not see the cut: {during}"
        c.hosts.heal(2)
        t_heal = time.monotonic()
        bus.overlaps.clear()
        bus.since_unix_s = time.time()  # what instances report from now on
        assert c.nats_current(2, 60), node_log(c, 3)  # nats-3 rejoined, JetStream current
        catch_up_s = time.monotonic() - t_heal
        while True:  # both instances heard from again and back in their own roles
            assert time.monotonic() - t_heal < 60, "instances not back in their roles"
            try:  # the test's own connection may be to nats-3, whose TCP resumes late
                st = await bus.status()
            except nats.errors.TimeoutError:
                continue
            present = {s["id"] for s in st["services"] if s["kind"] == "instance"}
            if present == {"instance-0", "instance-1"} and not st["healing"]["standing_in"]:
                break
            await asyncio.sleep(0.2)
        recovery_s = time.monotonic() - t_heal
        done = await asyncio.gather(*streams)
        lines = await batch_output(client, batch_id, 150)
        await asyncio.sleep(1.0)  # reports after the last request ended
    finally:
        await bus.close()
    lost, dup = once_each(lines, 40)
    assert (lost, dup) == (0, 0)
    num_errors = check_streams(done, 120)
    on_two = bus.on_two()
    assert on_two == [], f"requests on two instances after the heal: {on_two}"
    RESULTS.append(
        {
            "case": "NATS node partitioned: cut h2 (nats-3 + strict) 10 s, restore",
            "hosts": HOSTS,
            "load": "8 streams x 120 tok + batch 40 x 64 tok",
            "lost": lost,
            "duplicated": dup,
            "recovery_s": f"{catch_up_s:.1f}",
            "note": f"after restore: nats-3 current (/healthz) in {catch_up_s:.1f} s, both "
            f"instances in own roles in {recovery_s:.1f} s; jobs stream leader was {leader}; "
            f"{num_errors} of 8 streams ended with a clear error{first_error(done)}; "
            f"nats-3 during the cut: {during}; "
            f"{len(bus.overlaps)} overlaps seen, each a pull/push handoff",
        }
    )
