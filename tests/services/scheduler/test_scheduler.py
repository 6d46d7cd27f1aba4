from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from nats.aio.client import Client as NATS

from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    Heartbeat,
    InstanceReport,
    MigrateCommand,
    MigrateResult,
    ReqReport,
    RouteReply,
    RouteRequest,
)

pytestmark = pytest.mark.nats


def make_hb(sid: str, kind: str = "instance", model: str = "m") -> Heartbeat:
    return Heartbeat(
        service_id=sid,
        kind=kind,
        pid=os.getpid(),
        started_unix_s=time.time(),
        sent_unix_s=time.time(),
        model=model if kind == "instance" else "",
        engine="sim",
        is_emulated=True,
    )


def make_report(
    sid: str, index: int, role: str, seq: int = 1, requests: list[ReqReport] | None = None
) -> InstanceReport:
    return InstanceReport(
        instance_id=sid,
        index=index,
        seq=seq,
        sent_unix_s=time.time(),
        role=role,
        chunk_size=256,
        max_batch_reqs=64,
        block_size=16,
        num_blocks=1000,
        num_free_blocks=1000,
        kv_bytes_per_token=1000.0,
        step_model="linear",
        data_url="tcp://127.0.0.1:1",
        requests=requests or [],
    )


async def join(nc: NATS, sid: str, index: int, role: str) -> None:
    """An instance as the scheduler learns it: a heartbeat and a state report."""
    await nc.publish(subjects.instance_state(sid), codec.encode(make_report(sid, index, role)))
    await beat(nc, make_hb(sid))


async def status(nc: NATS) -> dict:
    return json.loads((await nc.request(subjects.CTL_STATUS, b"{}", timeout=2)).data)


async def route(
    nc: NATS, model: str = "m", req_class: str = "online", req_id: str = "r"
) -> RouteReply:
    ask = RouteRequest(
        req_id=req_id, model=model, req_class=req_class, max_tokens=4, num_prompt_chars=3
    )
    return codec.decode(
        (await nc.request(subjects.ROUTE, codec.encode(ask), timeout=2)).data, RouteReply
    )


async def beat(nc: NATS, hb: Heartbeat) -> None:
    await nc.publish(subjects.heartbeat(hb.kind, hb.service_id), codec.encode(hb))
    await nc.flush()
    await asyncio.sleep(0.05)


async def test_status_lists_services_learned_from_heartbeats(cluster: NATS) -> None:
    await beat(cluster, make_hb("inst-a"))
    await beat(cluster, make_hb("cpu-0", kind="cpu_attn"))
    st = await status(cluster)
    kinds = {(s["kind"], s["id"]) for s in st["services"]}
    assert {("instance", "inst-a"), ("cpu_attn", "cpu-0"), ("scheduler", "sched-t")} <= kinds
    inst = next(s for s in st["services"] if s["id"] == "inst-a")
    assert inst["emulated"] is True and inst["engine"] == "sim"


async def test_routes_by_the_policy_over_reports_and_answers_unknown_model(cluster: NATS) -> None:
    await join(cluster, "inst-a", 0, "aggregated")
    await join(cluster, "inst-b", 1, "aggregated")
    # `aggregated` routes to the instance with the fewest queued prompt tokens; a routed request
    # counts on its instance until a report shows it, so two arrivals spread over both.
    picks = [(await route(cluster, req_id=f"r{i}")).instance_id for i in range(2)]
    assert sorted(picks) == ["inst-a", "inst-b"]
    reply = await route(cluster, model="nope")
    assert reply.error_code == "unknown_model" and "m" in reply.message


async def test_pause_and_resume_offline_admission(cluster: NATS) -> None:
    await join(cluster, "inst-a", 0, "aggregated")
    reply = json.loads((await cluster.request(subjects.CTL_OFFLINE_PAUSE, b"", timeout=2)).data)
    assert reply == {"offline_paused": True}
    paused = await route(cluster, req_class="offline")
    assert paused.error_code == "offline_paused" and paused.retry_after_s > 0
    assert (await route(cluster, req_class="online")).instance_id == "inst-a"
    await cluster.request(subjects.CTL_OFFLINE_RESUME, b"{}", timeout=2)
    assert (await route(cluster, req_class="offline")).instance_id == "inst-a"
    assert (await status(cluster))["offline_paused"] is False


async def test_malformed_control_json_gets_an_error_and_the_scheduler_survives(
    cluster: NATS,
) -> None:
    reply = json.loads((await cluster.request(subjects.CTL_STATUS, b"{oops", timeout=2)).data)
    assert "malformed" in reply["error"]
    await cluster.publish(subjects.ROUTE, b"\x00\x01 not msgpack")
    await cluster.publish(subjects.heartbeat("instance", "x"), b"garbage")
    assert "services" in await status(cluster)


@pytest.mark.parametrize("cluster", ["tidal"], indirect=True)
async def test_a_request_for_a_slot_not_up_yet_waits_for_it(cluster: NATS) -> None:
    # `tidal` (embedded config): online prefill belongs on slot 0 (relaxed); only the strict
    # instance of slot 1 is up. It must not take the request (a strict instance never
    # prefills): the request waits until slot 0's instance reports, then goes there.
    await join(cluster, "inst-strict", 1, "strict")
    pending = asyncio.create_task(route(cluster, req_id="early"))
    await asyncio.sleep(0.3)
    assert not pending.done()
    await join(cluster, "inst-relaxed", 0, "relaxed")
    reply = await asyncio.wait_for(pending, 2)
    assert reply.instance_id == "inst-relaxed"


@pytest.mark.parametrize("cluster", ["tidal"], indirect=True)
async def test_a_push_whose_target_is_not_up_yet_happens_when_it_is(cluster: NATS) -> None:
    commands: list[MigrateCommand] = []

    async def on_migrate(msg) -> None:  # type: ignore[no-untyped-def]
        cmd = codec.decode(msg.data, MigrateCommand)
        commands.append(cmd)
        await msg.respond(codec.encode(MigrateResult(cmd.req_id, "ok")))

    await cluster.subscribe(subjects.instance_migrate("inst-relaxed"), cb=on_migrate)
    now = time.time()
    # Prefilled on the relaxed instance, first token out: tidal pushes it to the strict one.
    prefilled = ReqReport("q1", "online", "running", now, 37, 32, 37, 1, 3, 3.0, 0.25)
    up = ["inst-relaxed"]

    async def alive() -> None:  # the instances that are up keep reporting and heartbeating
        seq = 0
        while True:
            seq += 1
            for sid in up:
                index, role = (0, "relaxed") if sid == "inst-relaxed" else (1, "strict")
                reqs = [prefilled] if index == 0 else []
                rep = make_report(sid, index, role, seq=seq, requests=reqs)
                await cluster.publish(subjects.instance_state(sid), codec.encode(rep))
                await cluster.publish(
                    subjects.heartbeat("instance", sid), codec.encode(make_hb(sid))
                )
            await asyncio.sleep(0.05)

    beats = asyncio.create_task(alive())
    try:
        await asyncio.sleep(0.5)
        assert commands == []  # slot 1 is not up: nowhere to push yet, and no silent drop either
        up.append("inst-strict")
        for _ in range(60):
            if commands:
                break
            await asyncio.sleep(0.05)
    finally:
        beats.cancel()
    assert [(c.req_id, c.dst_instance_id, c.kind) for c in commands] == [
        ("q1", "inst-strict", "push")
    ]
