"""Migration between two live instances over a real nats-server and the TCP data plane: the
happy path, and each failure point of the handshake (refusal, a target that cannot be reached,
a commit whose answer never comes). In every case the request runs on exactly one instance and
the gateway subject receives each `seq` once, the text complete."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import connect
from services.instance import main as instance_main
from services.instance.dataplane import DataPlaneServer
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    GenerateAck,
    GenerateRequest,
    MigrateAbort,
    MigrateCommand,
    MigrateOfferReply,
    MigrateResult,
    SamplingSpec,
    TokenChunk,
)

pytestmark = pytest.mark.nats
GW = subjects.gateway_tokens("gw-mig")
NUM_TOKENS = 40


def instance_args(nats_url: str, iid: str, index: int) -> list[str]:
    # 20 ms emulated steps: 40 tokens take ~0.8 s, time enough to migrate mid-decode.
    return [
        *("--nats-url", nats_url, "--id", iid, "--index", str(index)),
        *("--policy", "aggregated", "--roles", "aggregated,aggregated"),
        *("--sim-step-model", "linear:0.02,0,0,0", "--tokenizer", "bytes"),
    ]


@contextlib.asynccontextmanager
async def running(nats_url: str, iid: str, index: int) -> AsyncIterator[None]:
    stop = asyncio.Event()
    args = instance_main.parse_args(instance_args(nats_url, iid, index))
    task = asyncio.create_task(instance_main.serve(args, stop))
    try:
        yield
    finally:
        stop.set()
        await task


@dataclass
class Gateway:
    """What a gateway subject receives."""

    chunks: list[TokenChunk] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_chunk(self, msg: Msg) -> None:
        chunk = codec.decode(msg.data, TokenChunk)
        self.chunks.append(chunk)
        if chunk.finish_reason:
            self.done.set()

    @property
    def tokens(self) -> list[TokenChunk]:
        return [c for c in self.chunks if not c.moved_to]


async def wait_ready(nc: NATS, iid: str) -> None:
    """An instance is ready once it publishes its state (after its subscriptions)."""
    first = asyncio.Event()

    async def on_state(msg: Msg) -> None:
        first.set()

    sub = await nc.subscribe(subjects.instance_state(iid), cb=on_state)
    await asyncio.wait_for(first.wait(), 30)
    await sub.unsubscribe()


async def start_request(nc: NATS, iid: str, gw: Gateway, req_id: str = "r1") -> None:
    await nc.subscribe(GW, cb=gw.on_chunk)
    req = GenerateRequest(
        req_id=req_id,
        model="tidal-sim",
        sampling=SamplingSpec(max_tokens=NUM_TOKENS),
        reply_subject=GW,
        prompt="migrate me over the sea",
    )
    reply = await nc.request(subjects.instance_submit(iid), codec.encode(req), timeout=2)
    assert codec.decode(reply.data, GenerateAck).ok
    while len(gw.tokens) < 5:  # decoding now
        await asyncio.sleep(0.01)


async def migrate(nc: NATS, src: str, dst: str, req_id: str = "r1") -> MigrateResult:
    cmd = MigrateCommand(req_id=req_id, dst_instance_id=dst, kind="pull")
    reply = await nc.request(subjects.instance_migrate(src), codec.encode(cmd), timeout=30)
    return codec.decode(reply.data, MigrateResult)


def assert_complete_once(gw: Gateway) -> None:
    seqs = [c.seq for c in gw.tokens]
    assert seqs == list(range(NUM_TOKENS)), seqs  # each seq once, in order, none missing
    assert gw.tokens[-1].finish_reason == "length"
    assert gw.tokens[-1].num_output_tokens == NUM_TOKENS


async def reference_text(nats_url: str) -> str:
    """The same request served by one instance that never migrates it."""
    async with running(nats_url, "ref", 0):
        nc = await connect(nats_url, "ref-client")
        await wait_ready(nc, "ref")
        gw = Gateway()
        await start_request(nc, "ref", gw, req_id="ref-r")
        await asyncio.wait_for(gw.done.wait(), 10)
        await nc.drain()
    return "".join(c.text for c in gw.tokens)


async def test_migrated_request_continues_on_the_target_with_the_same_output(
    nats_url: str,
) -> None:
    ref = await reference_text(nats_url)
    async with running(nats_url, "src", 0), running(nats_url, "dst", 1):
        nc = await connect(nats_url, "client")
        await wait_ready(nc, "src")
        await wait_ready(nc, "dst")
        gw = Gateway()
        await start_request(nc, "src", gw)
        res = await migrate(nc, "src", "dst")
        assert res.outcome == "ok", res
        assert res.num_bytes > 0 and res.transfer_s > 0
        await asyncio.wait_for(gw.done.wait(), 10)
        assert_complete_once(gw)
        moved = [c for c in gw.chunks if c.moved_to]
        assert [c.moved_to for c in moved] == ["dst"]
        assert {c.instance_id for c in gw.tokens if c.seq >= moved[0].seq} == {"dst"}
        assert "".join(c.text for c in gw.tokens) == ref
        await nc.drain()


async def test_refused_offer_leaves_the_request_on_the_source(nats_url: str) -> None:
    async with running(nats_url, "src", 0):
        nc = await connect(nats_url, "client")
        await wait_ready(nc, "src")

        async def refuse(msg: Msg) -> None:
            await msg.respond(codec.encode(MigrateOfferReply(ok=False, reason="no_room")))

        await nc.subscribe(subjects.migrate_offer("full"), cb=refuse)
        gw = Gateway()
        await start_request(nc, "src", gw)
        res = await migrate(nc, "src", "full")
        assert res.outcome == "refused" and "no_room" in res.message
        await asyncio.wait_for(gw.done.wait(), 10)
        assert_complete_once(gw)
        assert {c.instance_id for c in gw.tokens} == {"src"}
        await nc.drain()


async def test_unreachable_target_data_plane_rolls_back(nats_url: str) -> None:
    async with running(nats_url, "src", 0):
        nc = await connect(nats_url, "client")
        await wait_ready(nc, "src")
        aborts: list[MigrateAbort] = []

        async def accept(msg: Msg) -> None:  # says yes, but nothing listens on its data plane
            reply = MigrateOfferReply(ok=True, data_url="tcp://127.0.0.1:1", ticket="t1")
            await msg.respond(codec.encode(reply))

        async def on_abort(msg: Msg) -> None:
            aborts.append(codec.decode(msg.data, MigrateAbort))

        await nc.subscribe(subjects.migrate_offer("dead"), cb=accept)
        await nc.subscribe(subjects.migrate_abort("dead"), cb=on_abort)
        gw = Gateway()
        await start_request(nc, "src", gw)
        res = await migrate(nc, "src", "dead")
        assert res.outcome == "failed" and "data plane" in res.message
        await asyncio.wait_for(gw.done.wait(), 10)
        assert_complete_once(gw)
        assert {c.instance_id for c in gw.tokens} == {"src"}
        assert [a.ticket for a in aborts] == ["t1"]  # the target was told to drop its room
        await nc.drain()


async def test_commit_without_an_answer_is_aborted_and_the_source_keeps_running(
    nats_url: str,
) -> None:
    async with running(nats_url, "src", 0):
        nc = await connect(nats_url, "client")
        await wait_ready(nc, "src")
        received: list[bytes] = []
        aborts: list[MigrateAbort] = []

        async def keep(ticket: str, data: bytes) -> str:
            received.append(data)
            return ""

        plane = DataPlaneServer(keep, 1 << 30)
        url = await plane.start()

        async def accept(msg: Msg) -> None:
            await msg.respond(codec.encode(MigrateOfferReply(ok=True, data_url=url, ticket="t2")))

        async def silent_commit(msg: Msg) -> None:  # the target died after the bytes landed
            return

        async def on_abort(msg: Msg) -> None:
            aborts.append(codec.decode(msg.data, MigrateAbort))

        await nc.subscribe(subjects.migrate_offer("mute"), cb=accept)
        await nc.subscribe(subjects.migrate_commit("mute"), cb=silent_commit)
        await nc.subscribe(subjects.migrate_abort("mute"), cb=on_abort)
        gw = Gateway()
        await start_request(nc, "src", gw)
        res = await migrate(nc, "src", "mute")
        assert res.outcome == "failed" and "commit" in res.message
        assert len(received) == 1 and len(received[0]) == res.num_bytes
        await asyncio.wait_for(gw.done.wait(), 10)
        assert_complete_once(gw)
        assert {c.instance_id for c in gw.tokens} == {"src"}
        assert [a.ticket for a in aborts] == ["t2"]
        await plane.close()
        await nc.drain()
