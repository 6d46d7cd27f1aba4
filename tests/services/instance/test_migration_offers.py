"""The target's side of a migration offer, alone: a reservation whose answer was lost does not
block the same source's next offer of that request (a cut link lost the answer; the source
gave up and offers again), while a second source's offer of it is still a duplicate."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from services.instance.migration import Migrator
from tidal.plan import MigrationMode
from tidal.schemas.messages import MigrateOffer


def make_instance(free_blocks: int = 100) -> Any:
    engine = SimpleNamespace(
        capabilities=SimpleNamespace(migration=MigrationMode.KV),
        num_free_blocks=lambda: free_blocks,
    )
    adapter = SimpleNamespace(
        inst=SimpleNamespace(block_size=16), num_reserved_blocks=0, num_incoming=0
    )
    return SimpleNamespace(
        engine=engine, adapter=adapter, draining=False, streams={}, data_url="tcp://h:1"
    )


def offer(src: str = "instance-0", req_id: str = "r1") -> MigrateOffer:
    return MigrateOffer(
        req_id=req_id,
        src_instance_id=src,
        kind="push",
        num_kv_tokens=159,  # 160 with the next token: 10 blocks of 16
        num_bytes=0,
        reply_subject="tidal.tok.gw",
        next_seq=1,
        req_class="online",
    )


def test_the_same_source_offering_again_replaces_its_stale_reservation() -> None:
    inst = make_instance()
    m = Migrator(inst)
    first = m.reserve(offer())
    assert first.ok and inst.adapter.num_reserved_blocks == 10
    again = m.reserve(offer())  # the first answer was lost; the source offers again
    assert again.ok and again.ticket != first.ticket
    assert list(m.reservations) == [again.ticket]
    assert (inst.adapter.num_reserved_blocks, inst.adapter.num_incoming) == (10, 1)


def test_another_source_or_a_committed_request_is_still_a_duplicate() -> None:
    inst = make_instance()
    m = Migrator(inst)
    assert m.reserve(offer("instance-0")).ok
    other = m.reserve(offer("instance-2"))
    assert not other.ok and other.reason == "duplicate"
    inst.streams["r2"] = object()  # r2 runs here already
    mine = m.reserve(offer("instance-0", "r2"))
    assert not mine.ok and mine.reason == "duplicate"
