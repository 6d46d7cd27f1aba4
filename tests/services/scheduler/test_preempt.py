"""The scheduler's preempt signal (`--preempt-for-online`, `services/scheduler/preempt.py`) on the
live services over a real nats-server (sim engine): an online request that finds no KV room
where the policy routes it (an instance full of online work, which is never preempted) fails
there for lack of KV; with the signal it goes to the instance whose offline work the scheduler
had preempted, and runs at once; the offline work still completes, every token once. With
request classes, an online request of a higher class gets its room the same way from a lower
class's online work (`below_priority`), never from its own class's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.instance import main as instance_main
from tests.services.scheduler.scheduler_kit import running_scheduler
from tidal.schemas import codec, subjects
from tidal.schemas.control import CtlPreempt
from tidal.schemas.messages import (
    GenerateAck,
    GenerateRequest,
    RouteReply,
    RouteRequest,
    SamplingSpec,
    TokenChunk,
)

pytestmark = pytest.mark.nats
IIDS = ("inst-0", "inst-1")
PROMPT = "x" * 60  # 60 tokens with the bytes tokenizer: 4 KV blocks of 16 with its first token
# 10 KV blocks; the offline request (60 + 100 tokens) fills them all by its end
INSTANCE = ("--kv-cache-tokens", "160", "--max-model-len", "160", "--offline-chunk-tokens", "1")


class Stream:
    def __init__(self) -> None:
        self.chunks: list[TokenChunk] = []
        self.first_s = 0.0  # monotonic time of the first token
        self.done_s = 0.0  # ... of the last
        self.done = asyncio.Event()

    async def on_chunk(self, msg: Msg) -> None:
        chunk = codec.decode(msg.data, TokenChunk)
        self.chunks.append(chunk)
        self.first_s = self.first_s or time.monotonic()
        if chunk.finish_reason:
            self.done_s = time.monotonic()
            self.done.set()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def instance_args(nats_url: str, iid: str, index: int) -> list[str]:
    return [
        *("--nats-url", nats_url, "--id", iid, "--index", str(index)),
        *("--policy", "aggregated", "--roles", "aggregated,aggregated", "--tokenizer", "bytes"),
        *("--sim-step-model", "linear:0.02,0,0,0", *INSTANCE),
    ]


@contextlib.asynccontextmanager
async def stack(nats_url: str, preempt: bool) -> AsyncIterator[NATS]:
    """Two sim instances and a scheduler that routes by the `aggregated` policy."""
    flag = "--preempt-for-online" if preempt else "--no-preempt-for-online"
    sched = [
        *("--nats-url", nats_url, "--policy", "aggregated", "--roles", "aggregated,aggregated"),
        flag,
    ]
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(
            instance_main.serve(instance_main.parse_args(instance_args(nats_url, iid, i)), stop)
        )
        for i, iid in enumerate(IIDS)
    ]
    try:
        async with running_scheduler(nats_url, sched) as nc:
            yield nc
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def submit(
    nc: NATS, iid: str, req_id: str, req_class: str, max_tokens: int, priority: int = 0
) -> Stream:
    s = Stream()
    subject = subjects.gateway_tokens(f"gw-{req_id}")
    await nc.subscribe(subject, cb=s.on_chunk)
    req = GenerateRequest(
        req_id=req_id,
        model="tidal-sim",
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        reply_subject=subject,
        req_class=req_class,
        prompt=PROMPT,
        priority=priority,
    )
    reply = await nc.request(subjects.instance_submit(iid), codec.encode(req), timeout=10)
    assert codec.decode(reply.data, GenerateAck).ok
    return s


async def known(nc: NATS) -> None:
    """Until the scheduler has heard both instances."""
    async with asyncio.timeout(20):
        while True:
            status = (await nc.request(subjects.CTL_STATUS, b"{}", timeout=5)).data
            if all(iid.encode() in status for iid in IIDS):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # and their reports


async def route(nc: NATS, req_id: str, priority: int = 0) -> RouteReply:
    ask = RouteRequest(
        req_id, "tidal-sim", "online", 10, len(PROMPT), num_prompt_tokens=60, priority=priority
    )
    msg = await nc.request(subjects.ROUTE, codec.encode(ask), timeout=5)
    return codec.decode(msg.data, RouteReply)


@pytest.mark.parametrize("preempt", [True, False])
async def test_an_online_request_gets_room_by_a_preempt_signal(
    nats_url: str, preempt: bool
) -> None:
    async with stack(nats_url, preempt) as nc:
        signals: list[tuple[str, CtlPreempt]] = []
        for iid in IIDS:  # listen beside the instances

            async def on_signal(msg: Msg, iid: str = iid) -> None:
                signals.append((iid, msgspec.json.decode(msg.data, type=CtlPreempt)))

            await nc.subscribe(subjects.instance_preempt(iid), cb=on_signal)
        await nc.flush()
        await known(nc)
        # inst-0: an online request holds the KV (it is never preempted); inst-1: offline work
        hog = await submit(nc, "inst-0", "hog", "online", 100)
        offline = await submit(nc, "inst-1", "off", "offline", 100)
        async with asyncio.timeout(20):
            while min(hog.num_tokens, offline.num_tokens) < 45:  # 105 tokens: 7 blocks held
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # reports show it: 3 blocks free on each, 4 needed
        reply = await route(nc, "on")
        online = await submit(nc, reply.instance_id, "on", "online", 10)
        async with asyncio.timeout(30):
            await asyncio.gather(online.done.wait(), offline.done.wait(), hog.done.wait())
        assert hog.num_tokens == 100
        assert offline.num_tokens == 100  # nothing lost, nothing twice
        assert [c.seq for c in offline.chunks] == list(range(len(offline.chunks)))
        assert offline.chunks[-1].finish_reason == "length"
        if preempt:
            assert reply.instance_id == "inst-1"
            assert [(iid, s.num_blocks) for iid, s in signals] == [("inst-1", 1)]
            assert online.num_tokens == 10 and online.chunks[-1].finish_reason == "length"
            assert online.first_s < hog.done_s  # it did not wait for the online hog
        else:  # the policy's least loaded instance (a tie: the first), its KV held online
            assert reply.instance_id == "inst-0"
            assert signals == []
            [end] = online.chunks  # ended for lack of KV: the hog grew into all of it
            assert end.finish_reason == "error" and "out of KV memory" in end.error


async def test_a_higher_class_gets_room_from_a_lower_class_by_the_signal(nats_url: str) -> None:
    async with stack(nats_url, True) as nc:
        signals: list[tuple[str, CtlPreempt]] = []
        for iid in IIDS:

            async def on_signal(msg: Msg, iid: str = iid) -> None:
                signals.append((iid, msgspec.json.decode(msg.data, type=CtlPreempt)))

            await nc.subscribe(subjects.instance_preempt(iid), cb=on_signal)
        await nc.flush()
        await known(nc)
        # inst-0: a standard (priority 1) request holds the KV; inst-1: an interactive one (2)
        std = await submit(nc, "inst-0", "std", "online", 100, priority=1)
        top = await submit(nc, "inst-1", "top", "online", 100, priority=2)
        async with asyncio.timeout(20):
            while min(std.num_tokens, top.num_tokens) < 45:  # 7 of 10 blocks held on each
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        reply = await route(nc, "on", priority=2)  # interactive: standard's KV may go
        online = await submit(nc, reply.instance_id, "on", "online", 10, priority=2)
        async with asyncio.timeout(30):
            await asyncio.gather(online.done.wait(), std.done.wait(), top.done.wait())
        assert reply.instance_id == "inst-0"
        assert [(iid, s.num_blocks, s.below_priority) for iid, s in signals] == [("inst-0", 1, 2)]
        assert online.num_tokens == 10 and online.chunks[-1].finish_reason == "length"
        assert online.first_s < std.done_s  # it did not wait for the standard request
        for s in (std, top):  # the evicted standard request recomputed: nothing lost, no repeat
            assert s.num_tokens == 100 and s.chunks[-1].finish_reason == "length"
            assert [c.seq for c in s.chunks] == list(range(len(s.chunks)))
