"""Migration between two live instances over a real nats-server and the TCP data plane: the
happy path, and each failure point of the handshake (issue 11, item 6). The target fails: it
refuses, is gone (no responder), hangs on the offer, cannot be reached on its data plane, or
never answers the commit. The step times out: a commit answered too late is aborted, and a
target still importing drops the request. The source dies: the target's reservation expires
and a late commit is refused (`test_migration_source_dies.py`). In every case the request runs
on exactly one instance and the gateway subject receives each `seq` once, the text complete.
Each test runs on the sim engine and (slow) on the torch engine with the tiny random Llama."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg

from services.common.bus import connect
from services.instance import migration
from services.instance.dataplane import DataPlaneServer
from tests.services.instance.migration_kit import (
    GW,
    CountingReceiver,
    EngineKind,
    Gateway,
    migrate,
    reference_text,
    running,
    start_request,
    wait_report,
)
from tidal.schemas import codec, subjects
from tidal.schemas.messages import MigrateAbort, MigrateOfferReply

pytestmark = pytest.mark.nats


async def test_migrated_request_continues_on_the_target_with_the_same_output(
    nats_url: str, engine_kind: EngineKind
) -> None:
    ref = await reference_text(nats_url, engine_kind)
    async with running(nats_url, "src", 0, engine_kind), running(nats_url, "dst", 1, engine_kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")
        await wait_report(nc, "dst")
        gw = Gateway()
        await start_request(nc, "src", gw, engine_kind)
        res = await migrate(nc, "src", "dst")
        assert res.outcome == "ok", res
        assert res.num_bytes > 0 and res.transfer_s > 0
        await asyncio.wait_for(gw.done.wait(), 60)
        gw.assert_complete_once(engine_kind.num_tokens)
        moved = [c for c in gw.chunks if c.moved_to]
        assert [c.moved_to for c in moved] == ["dst"]
        assert {c.instance_id for c in gw.tokens if c.seq >= moved[0].seq} == {"dst"}
        assert "".join(c.text for c in gw.tokens) == ref
        await nc.drain()


async def test_refused_offer_leaves_the_request_on_the_source(
    nats_url: str, engine_kind: EngineKind
) -> None:
    async with running(nats_url, "src", 0, engine_kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")

        async def refuse(msg: Msg) -> None:
            await msg.respond(codec.encode(MigrateOfferReply(ok=False, reason="no_room")))

        await nc.subscribe(subjects.migrate_offer("full"), cb=refuse)
        gw = Gateway()
        await start_request(nc, "src", gw, engine_kind)
        res = await migrate(nc, "src", "full")
        assert res.outcome == "refused" and "no_room" in res.message
        await asyncio.wait_for(gw.done.wait(), 60)
        gw.assert_complete_once(engine_kind.num_tokens)
        assert {c.instance_id for c in gw.tokens} == {"src"}
        await nc.drain()


@pytest.mark.parametrize("target", ["gone", "hung"])
async def test_target_that_does_not_answer_the_offer_leaves_the_request_on_the_source(
    nats_url: str, engine_kind: EngineKind, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migration, "OFFER_TIMEOUT_S", 0.5)
    async with running(nats_url, "src", 0, engine_kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")
        offers: list[Msg] = []
        if target == "hung":  # it takes the offer and never answers (stuck, or died in it)

            async def hang(msg: Msg) -> None:
                offers.append(msg)

            await nc.subscribe(subjects.migrate_offer(target), cb=hang)
        gw = Gateway()
        await start_request(nc, "src", gw, engine_kind)
        res = await migrate(nc, "src", target)
        assert res.outcome == "failed" and "did not answer the offer" in res.message
        assert len(offers) == (target == "hung")
        await asyncio.wait_for(gw.done.wait(), 60)
        gw.assert_complete_once(engine_kind.num_tokens)
        assert {c.instance_id for c in gw.tokens} == {"src"}
        await nc.drain()


async def test_unreachable_target_data_plane_rolls_back(
    nats_url: str, engine_kind: EngineKind
) -> None:
    async with running(nats_url, "src", 0, engine_kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")
        aborts: list[MigrateAbort] = []

        async def accept(msg: Msg) -> None:  # says yes, but nothing listens on its data plane
            reply = MigrateOfferReply(ok=True, data_url="tcp://127.0.0.1:1", ticket="t1")
            await msg.respond(codec.encode(reply))

        async def on_abort(msg: Msg) -> None:
            aborts.append(codec.decode(msg.data, MigrateAbort))

        await nc.subscribe(subjects.migrate_offer("dead"), cb=accept)
        await nc.subscribe(subjects.migrate_abort("dead"), cb=on_abort)
        gw = Gateway()
        await start_request(nc, "src", gw, engine_kind)
        res = await migrate(nc, "src", "dead")
        assert res.outcome == "failed" and "data plane" in res.message
        await asyncio.wait_for(gw.done.wait(), 60)
        gw.assert_complete_once(engine_kind.num_tokens)
        assert {c.instance_id for c in gw.tokens} == {"src"}
        assert [a.ticket for a in aborts] == ["t1"]  # the target was told to drop its room
        await nc.drain()


async def test_commit_without_an_answer_is_aborted_and_the_source_keeps_running(
    nats_url: str, engine_kind: EngineKind
) -> None:
    async with running(nats_url, "src", 0, engine_kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")
        receiver = CountingReceiver()
        aborts: list[MigrateAbort] = []
        plane = DataPlaneServer(receiver)
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
        await start_request(nc, "src", gw, engine_kind)
        res = await migrate(nc, "src", "mute")
        assert res.outcome == "failed" and "commit" in res.message
        assert receiver.received == {"t2": res.num_bytes} and res.num_bytes > 0
        await asyncio.wait_for(gw.done.wait(), 60)
        gw.assert_complete_once(engine_kind.num_tokens)
        assert {c.instance_id for c in gw.tokens} == {"src"}
        assert [a.ticket for a in aborts] == ["t2"]
        await plane.close()
        await nc.drain()


async def test_commit_answered_too_late_runs_the_request_on_the_source_only(
    nats_url: str, engine_kind: EngineKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step times out while the target still imports: the source aborts and rolls back;
    the target, its import done, must drop the request rather than start it as well."""
    cls: type
    if engine_kind.name == "sim":
        from tidal.engine.sim.engine import SimEngine as cls
    else:
        from tidal.engine.torch.engine import TorchEngine as cls
    fast_end = cls.end_import

    def end_import_slowly(self: object, req_id: str, commit: bool) -> None:
        if commit:
            time.sleep(0.5)  # in the import's worker thread, while the commit waits 0.1 s
        fast_end(self, req_id, commit)

    monkeypatch.setattr(cls, "end_import", end_import_slowly)
    monkeypatch.setattr(migration, "COMMIT_TIMEOUT_S", 0.1)
    async with running(nats_url, "src", 0, engine_kind), running(nats_url, "dst", 1, engine_kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")
        await wait_report(nc, "dst")
        gw = Gateway()
        await start_request(nc, "src", gw, engine_kind)
        res = await migrate(nc, "src", "dst")
        assert res.outcome == "failed" and "commit" in res.message
        await asyncio.wait_for(gw.done.wait(), 60)
        gw.assert_complete_once(engine_kind.num_tokens)
        assert {c.instance_id for c in gw.chunks} == {"src"}
        # the target holds nothing: no request, no reserved blocks
        await wait_report(nc, "dst", lambda r: not r.requests and r.num_free_blocks == r.num_blocks)
        await nc.drain()


async def test_commands_for_two_requests_run_side_by_side(
    nats_url: str, engine_kind: EngineKind
) -> None:
    """A source handles each migration command in its own task: a target that answers an
    offer only once it holds two sees both, where commands handled one after the other would
    leave the first unanswered until it timed out."""
    async with running(nats_url, "src", 0, engine_kind):
        nc = await connect(nats_url, "client")
        await wait_report(nc, "src")
        offers: list[Msg] = []

        async def pair(msg: Msg) -> None:
            offers.append(msg)
            if len(offers) == 2:
                for m in offers:
                    await m.respond(codec.encode(MigrateOfferReply(ok=False, reason="no_room")))

        await nc.subscribe(subjects.migrate_offer("pair"), cb=pair)
        gws = {rid: Gateway() for rid in ("r1", "r2")}
        for rid, gw in gws.items():
            await start_request(nc, "src", gw, engine_kind, rid, subject=f"{GW}-{rid}")
        results = await asyncio.gather(*(migrate(nc, "src", "pair", rid) for rid in gws))
        assert [(r.req_id, r.outcome) for r in results] == [("r1", "refused"), ("r2", "refused")]
        for gw in gws.values():
            await asyncio.wait_for(gw.done.wait(), 60)
            gw.assert_complete_once(engine_kind.num_tokens)
        await nc.drain()
