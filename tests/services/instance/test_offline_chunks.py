"""Live instances over a real nats-server: an offline request's tokens go out in fewer, larger
chunks (`services.instance.chunks`), an online request's one chunk per step, and nothing is lost
or reordered when the request leaves the instance: migration, cancel, drain."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from services.common.bus import connect
from services.instance import main as instance_main
from tests.services.instance.migration_kit import (
    EngineKind,
    Gateway,
    instance_args,
    migrate,
    reference_text,
    sim_kind,
    wait_report,
)
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    CancelRequest,
    GenerateAck,
    GenerateRequest,
    InstanceReport,
    ReqReport,
    SamplingSpec,
)

pytestmark = pytest.mark.nats
SIM = sim_kind()  # 20 ms emulated steps, 40-token requests
HOLD_ALL = ("--offline-chunk-tokens", "1000", "--offline-chunk-s", "2")  # held to the end


def kind(*coalescing: str) -> EngineKind:
    return EngineKind("sim", (*SIM.args, *coalescing), SIM.num_tokens)


@contextlib.asynccontextmanager
async def running(
    nats_url: str, iid: str, index: int, k: EngineKind, *extra: str
) -> AsyncIterator[NATS]:
    """An instance, and a client that has seen its first report."""
    args = instance_main.parse_args([*instance_args(nats_url, iid, index, k), *extra])
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(args, stop))
    nc = await connect(nats_url, f"client-{iid}")
    try:
        await wait_report(nc, iid)
        yield nc
    finally:
        stop.set()
        await task
        await nc.drain()


async def submit(
    nc: NATS, iid: str, gw: Gateway, req_id: str, req_class: str, num_tokens: int = 40
) -> None:
    subject = subjects.gateway_tokens(f"gw-{req_id}")
    await nc.subscribe(subject, cb=gw.on_chunk)
    req = GenerateRequest(
        req_id=req_id,
        model="tidal-sim",
        sampling=SamplingSpec(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
        reply_subject=subject,
        req_class=req_class,
        prompt="migrate me over the sea",  # the prompt of `reference_text`
    )
    reply = await nc.request(subjects.instance_submit(iid), codec.encode(req), timeout=10)
    assert codec.decode(reply.data, GenerateAck).ok


async def decoding(nc: NATS, iid: str, req_id: str, num_tokens: int = 5) -> ReqReport:
    """The first report of `iid` in which `req_id` has made `num_tokens` tokens."""
    seen: list[ReqReport] = []

    def ok(rep: InstanceReport) -> bool:
        seen.extend(r for r in rep.requests if r.req_id == req_id)
        return bool(seen) and seen[-1].num_output_tokens >= num_tokens

    await wait_report(nc, iid, ok)
    return seen[-1]


def assert_whole(gw: Gateway, ref: str, num_tokens: int = 40) -> None:
    """Every token once, in order, in chunks numbered without a gap."""
    assert [c.seq for c in gw.tokens] == list(range(len(gw.tokens)))
    assert sum(c.num_tokens for c in gw.tokens) == num_tokens
    assert sum(len(c.token_ids) for c in gw.tokens) == num_tokens
    assert "".join(c.text for c in gw.tokens) == ref
    assert gw.tokens[-1].finish_reason == "length"
    assert gw.tokens[-1].num_output_tokens == num_tokens
    assert [c.finish_reason for c in gw.tokens[:-1]] == [None] * (len(gw.tokens) - 1)


async def test_offline_tokens_go_out_in_chunks_of_max_tokens_online_ones_per_step(
    nats_url: str,
) -> None:
    ref = await reference_text(nats_url, SIM)
    async with running(nats_url, "inst", 0, kind("--offline-chunk-tokens", "8")) as nc:
        offline, online = Gateway(), Gateway()
        await submit(nc, "inst", offline, "off", "offline")
        await submit(nc, "inst", online, "on", "online")
        await asyncio.wait_for(asyncio.gather(offline.done.wait(), online.done.wait()), 30)
    assert_whole(offline, ref)
    assert_whole(online, ref)
    assert [c.num_tokens for c in online.tokens] == [1] * 40  # unchanged
    sizes = [c.num_tokens for c in offline.tokens]
    assert max(sizes) == 8 and len(sizes) < 40, sizes


async def test_offline_tokens_go_out_once_the_oldest_is_max_age_old(nats_url: str) -> None:
    ref = await reference_text(nats_url, SIM)
    k = kind("--offline-chunk-tokens", "1000", "--offline-chunk-s", "0.1")
    async with running(nats_url, "inst", 0, k) as nc:
        gw = Gateway()
        await submit(nc, "inst", gw, "off", "offline")
        await asyncio.wait_for(gw.done.wait(), 30)
    assert_whole(gw, ref)
    # 40 emulated 20 ms steps take 0.8 s or more: a chunk every 0.1 s or so, not one at the end
    assert len(gw.tokens) >= 2 and all(c.num_tokens < 40 for c in gw.tokens)


async def test_chunk_tokens_zero_is_one_chunk_per_step_for_offline_too(nats_url: str) -> None:
    async with running(nats_url, "inst", 0, kind("--offline-chunk-tokens", "0")) as nc:
        gw = Gateway()
        await submit(nc, "inst", gw, "off", "offline")
        await asyncio.wait_for(gw.done.wait(), 30)
    assert [c.num_tokens for c in gw.tokens] == [1] * 40


async def test_the_policy_sees_held_tokens_when_they_are_made(nats_url: str) -> None:
    """`on_tokens` (the request's first/last token times in reports) is not deferred."""
    async with running(nats_url, "inst", 0, kind(*HOLD_ALL)) as nc:
        gw = Gateway()
        await submit(nc, "inst", gw, "off", "offline")
        rep = await decoding(nc, "inst", "off", num_tokens=3)
        assert not gw.chunks  # nothing published yet
        assert 0 < rep.first_token_unix_s < rep.last_token_unix_s
        await asyncio.wait_for(gw.done.wait(), 30)
    assert sum(c.num_tokens for c in gw.tokens) == 40


async def test_a_migration_publishes_the_held_tokens_before_the_target_continues(
    nats_url: str,
) -> None:
    ref = await reference_text(nats_url, SIM)
    k = kind(*HOLD_ALL)
    async with running(nats_url, "src", 0, k) as nc, running(nats_url, "dst", 1, k):
        gw = Gateway()
        await submit(nc, "src", gw, "r1", "offline")
        await decoding(nc, "src", "r1")
        assert not gw.chunks
        res = await migrate(nc, "src", "dst")
        assert res.outcome == "ok", res
        await asyncio.wait_for(gw.done.wait(), 30)
    assert_whole(gw, ref)
    first, moved = gw.chunks[0], gw.chunks[1]
    assert first.instance_id == "src" and first.seq == 0 and first.num_tokens >= 5
    assert first.token_ids and first.finish_reason is None
    assert moved.moved_to == "dst" and moved.seq == 1
    assert {c.instance_id for c in gw.tokens[1:]} == {"dst"}


async def test_a_cancel_publishes_the_held_tokens_and_nothing_after(nats_url: str) -> None:
    async with running(nats_url, "inst", 0, kind(*HOLD_ALL)) as nc:
        gw = Gateway()
        await submit(nc, "inst", gw, "off", "offline", num_tokens=200)
        await decoding(nc, "inst", "off")
        await nc.publish(subjects.CANCEL, codec.encode(CancelRequest(req_id="off")))
        await wait_report(nc, "inst", lambda rep: not any(r.req_id == "off" for r in rep.requests))
        await asyncio.sleep(0.3)
    (held,) = gw.chunks  # one chunk: what was held when the cancel came
    assert held.seq == 0 and held.finish_reason is None and 5 <= held.num_tokens < 200
    assert held.num_output_tokens == held.num_tokens == len(held.token_ids)


async def test_a_drain_publishes_the_held_tokens_then_the_abort(nats_url: str) -> None:
    gw = Gateway()
    argv = [*instance_args(nats_url, "inst", 0, kind(*HOLD_ALL)), "--drain-timeout-s", "0.1"]
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(instance_main.parse_args(argv), stop))
    nc = await connect(nats_url, "client")
    try:
        await wait_report(nc, "inst")
        await submit(nc, "inst", gw, "off", "offline", num_tokens=200)
        await decoding(nc, "inst", "off")
        stop.set()  # SIGTERM: drain for 0.1 s, then abort what still runs
        await task
        await asyncio.wait_for(gw.done.wait(), 10)
    finally:
        stop.set()
        await task
        await nc.drain()
    held, abort = gw.chunks
    assert (held.seq, abort.seq) == (0, 1)
    assert held.finish_reason is None and 5 <= held.num_tokens == len(held.token_ids) < 200
    assert abort.finish_reason == "abort" and abort.num_tokens == 0
    assert abort.error == "instance shutting down"
