"""The failure point where the source dies mid-handshake (issue 11, item 6): after its offer
was accepted and its bytes sent, no commit ever comes. The target's reservation expires on its
own (no further offer needed), its blocks are free again, a late commit for it is refused, and
nothing ever streams from the target: the gateway's recompute (tests/fault) resumes the request
from its prompt and the tokens already streamed, on exactly one instance."""

from __future__ import annotations

import pytest

from services.common.bus import connect
from services.instance import main as instance_main
from services.instance import migration_in
from services.instance.dataplane import send_kv
from services.instance.engines import build_engine
from tests.services.instance.migration_kit import (
    GW,
    EngineKind,
    Gateway,
    instance_args,
    running,
    wait_report,
)
from tidal.engine.api import EngineRequest, SamplingParams
from tidal.schemas import codec, subjects
from tidal.schemas.messages import MigrateCommit, MigrateOffer, MigrateOfferReply

pytestmark = pytest.mark.nats


async def test_reservation_of_a_dead_source_expires_and_a_late_commit_is_refused(
    nats_url: str, engine_kind: EngineKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migration_in, "RESERVATION_TTL_S", 2.0)
    async with running(nats_url, "dst", 1, engine_kind):
        nc = await connect(nats_url, "client")
        gw = Gateway()
        await nc.subscribe(GW, cb=gw.on_chunk)
        await wait_report(nc, "dst")
        # the dying source: an engine like the target's, holding a request with some KV
        args = instance_main.parse_args(instance_args(nats_url, "gone", 0, engine_kind))
        src = build_engine(args)
        src.add(EngineRequest("ghost", list(range(1, 41)), SamplingParams(max_tokens=20)))
        while not src.step().events:
            pass
        source = src.begin_export("ghost")
        offer = MigrateOffer(
            req_id="ghost",
            src_instance_id="src-that-dies",
            kind="pull",
            num_kv_tokens=source.num_tokens,
            num_bytes=source.num_tokens * source.bytes_per_token,
            reply_subject=GW,
            next_seq=5,
            req_class="offline",
        )
        msg = await nc.request(subjects.migrate_offer("dst"), codec.encode(offer), timeout=10)
        reply = codec.decode(msg.data, MigrateOfferReply)
        assert reply.ok, reply
        await send_kv(reply.data_url, reply.ticket, source)  # its KV lands in reserved blocks
        # The source is gone now. The target held room for the request ...
        await wait_report(nc, "dst", lambda r: r.num_free_blocks < r.num_blocks)
        # ... and gives it back once the reservation expires, with no other offer to trigger it.
        await wait_report(nc, "dst", lambda r: r.num_free_blocks == r.num_blocks)
        late = MigrateCommit("ghost", reply.ticket)
        msg = await nc.request(subjects.migrate_commit("dst"), codec.encode(late), timeout=10)
        done = codec.decode(msg.data, MigrateOfferReply)
        assert not done.ok and "expired" in done.reason
        await wait_report(nc, "dst", lambda r: not r.requests)
        assert gw.chunks == []  # nothing ever streamed from the target
        await nc.drain()
