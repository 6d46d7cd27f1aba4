"""The target side of a migration (`migration.py` has the handshake and the source side):
reserve KV blocks for an offer, take the request's state and KV from the data plane's threads,
make it this instance's own on the commit, drop it on an abort, and free a reservation whose
commit never comes (its source died)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from services.common.bus import respond
from services.instance.dataplane import TransferRefused
from services.instance.policy_adapter import ReqMeta
from services.instance.worker import Instance, Stream
from tidal.engine.migrate import KvSink, MovableEngine
from tidal.policy.state import Slo
from tidal.schemas import kv_wire
from tidal.schemas.messages import MigrateAbort, MigrateCommit, MigrateOffer, MigrateOfferReply

log = logging.getLogger("tidal.migration")

OPEN_TIMEOUT_S = 30.0  # a data-plane thread waits this long for the engine to reserve blocks
RESERVATION_TTL_S = 120.0  # a reservation whose commit never comes is freed (the source died)


@dataclass
class Reservation:
    offer: MigrateOffer
    num_blocks: int
    expires_s: float
    sink: KvSink | None = None  # the engine's import, once the state arrived
    arrived: bool = False  # every KV byte written
    committed: bool = False
    aborted: bool = False  # aborted or expired: a commit in progress must not start it
    released: bool = False  # its blocks and incoming count handed back (once)


class Importer:
    """The target side, mixed into `migration.Migrator` (which owns these attributes)."""

    inst: Instance
    mover: MovableEngine
    reservations: dict[str, Reservation]  # ticket -> reservation
    loop: asyncio.AbstractEventLoop | None = None

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        raise NotImplementedError

    async def on_offer(self, offer: MigrateOffer, msg: Msg) -> None:
        await respond(msg, self.reserve(offer))

    def reserve(self, offer: MigrateOffer) -> MigrateOfferReply:
        inst, adapter = self.inst, self.inst.adapter
        self.expire()
        if inst.draining:
            return MigrateOfferReply(ok=False, reason="draining")
        if offer.req_id in inst.streams:
            return MigrateOfferReply(ok=False, reason="duplicate")
        for ticket, r in list(self.reservations.items()):
            if r.offer.req_id != offer.req_id:
                continue
            if r.committed or r.offer.src_instance_id != offer.src_instance_id:
                return MigrateOfferReply(ok=False, reason="duplicate")
            # NOTE: the same source offers the request again, so its earlier handshake ended
            # uncommitted (a source runs one handshake per request at a time): our answer or
            # its abort was lost, say in a cut link. Refusing as a duplicate until the stale
            # reservation expired kept the request off this instance for minutes.
            log.warning("stale reservation for %s replaced by a new offer", offer.req_id)
            self._drop_stale(ticket, r)
        bs = adapter.inst.block_size
        need = -(-(offer.num_kv_tokens + 1) // bs)  # its KV and the next token's slot
        free = inst.engine.num_free_blocks() - adapter.num_reserved_blocks
        if need > free:
            return MigrateOfferReply(ok=False, reason=f"no_room: needs {need} blocks, {free} free")
        ticket = uuid.uuid4().hex
        self.reservations[ticket] = Reservation(offer, need, time.monotonic() + RESERVATION_TTL_S)
        adapter.num_reserved_blocks += need
        adapter.num_incoming += 1
        return MigrateOfferReply(ok=True, data_url=inst.data_url, ticket=ticket)

    # the data plane's `Receiver`: called on its threads, carried out on the event loop

    def open_transfer(self, hello: kv_wire.Hello, state: bytes) -> KvSink:
        if self.loop is None:
            raise TransferRefused("instance not ready")
        fut = asyncio.run_coroutine_threadsafe(self._open(hello, state), self.loop)
        try:
            return fut.result(OPEN_TIMEOUT_S)
        except TimeoutError:
            # not cancelled: an import it still makes is dropped by the source's abort (or the
            # reservation's expiry), which it checks for once it has the blocks
            raise TransferRefused("the engine did not reserve blocks in time") from None

    async def _open(self, hello: kv_wire.Hello, state: bytes) -> KvSink:
        res = self.reservations.get(hello.ticket)
        if res is None or res.aborted:
            raise TransferRefused("unknown or expired ticket")
        if res.sink is not None:
            raise TransferRefused("this ticket already has its transfer")
        try:
            async with self.inst.engine_lock:
                if res.aborted:
                    raise TransferRefused("aborted by the source")
                sink = await self.inst.compute.run(self.mover.begin_import, state)
                if res.aborted:  # aborted or expired while the blocks were being reserved
                    await self.inst.compute.run(self.mover.end_import, sink.req_id, False)
                    raise TransferRefused("aborted by the source")
        except (ValueError, MemoryError) as exc:
            raise TransferRefused(f"import refused: {exc}") from None
        res.sink = sink
        # its blocks are the engine's now: no longer counted as reserved beside them
        self.inst.adapter.num_reserved_blocks -= res.num_blocks
        res.num_blocks = 0
        return sink

    def end_transfer(self, ticket: str, error: str) -> None:
        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(self._close(ticket, error), self.loop)

    async def _close(self, ticket: str, error: str) -> None:
        res = self.reservations.get(ticket)
        if res is None:
            return
        if error:
            log.warning("KV of %s did not arrive: %s", res.offer.req_id, error)
            await self._drop_import(res)
        else:
            res.arrived = True

    async def _drop_import(self, res: Reservation) -> None:
        """Free what an import that will not be committed holds (once)."""
        sink, res.sink = res.sink, None
        if sink is not None:
            async with self.inst.engine_lock:
                await self.inst.compute.run(self.mover.end_import, sink.req_id, False)

    async def on_commit(self, commit: MigrateCommit, msg: Msg) -> None:
        # in a task: each commit waits for this engine's lock; one per step, not one per commit
        self._spawn(self._commit_reply(commit, msg), f"commit of {commit.req_id}")

    async def _commit_reply(self, commit: MigrateCommit, msg: Msg) -> None:
        await respond(msg, await self.commit(commit))

    async def commit(self, commit: MigrateCommit) -> MigrateOfferReply:
        inst = self.inst
        res = self.reservations.get(commit.ticket)
        if res is None or res.offer.req_id != commit.req_id:
            return MigrateOfferReply(ok=False, reason="unknown or expired ticket")
        if res.sink is None or not res.arrived:
            return MigrateOfferReply(ok=False, reason="its KV has not arrived")
        self._release(commit.ticket)
        offer = res.offer
        async with inst.engine_lock:
            if res.aborted:  # the abort landed while this commit waited for the engine
                return MigrateOfferReply(ok=False, reason="aborted by the source")
            sink, res.sink = res.sink, None
            try:
                await self.inst.compute.run(self.mover.end_import, sink.req_id, True)
            except (ValueError, MemoryError) as exc:
                return MigrateOfferReply(ok=False, reason=f"import failed: {exc}")
            if res.aborted:
                # NOTE: the source gave up on this commit while it was carried out and runs the
                # request itself again: starting it here would run it twice.
                inst.engine.abort(offer.req_id)
                log.warning("migration of %s aborted during its commit", offer.req_id)
                return MigrateOfferReply(ok=False, reason="aborted by the source")
        slo = Slo(offer.ttft_slo_s, offer.tpot_slo_s) if offer.ttft_slo_s > 0 else None
        meta = ReqMeta(slo, offer.arrival_unix_s or time.time())
        meta.num_migrations = 1
        meta.start_unix_s = meta.first_token_unix_s = meta.last_token_unix_s = time.time()
        if offer.first_token_unix_s > 0:  # the TPOT counts from its first token, hand-off in
            meta.first_token_unix_s = offer.first_token_unix_s
        inst.adapter.meta[offer.req_id] = meta
        inst.streams[offer.req_id] = Stream(offer.reply_subject, offer.next_seq)
        res.committed = True  # kept, committed, so that a late abort finds it
        inst.wake.set()
        return MigrateOfferReply(ok=True, ticket=commit.ticket)

    async def on_abort(self, abort: MigrateAbort, msg: Msg) -> None:
        res = self.reservations.get(abort.ticket)
        if res is None:
            return
        inst = self.inst
        if res.committed:
            # The source did not hear our commit answer and runs the request itself again.
            log.warning("migration of %s aborted after commit: dropping it", abort.req_id)
            async with inst.engine_lock:
                inst.engine.abort(abort.req_id)
            inst.streams.pop(abort.req_id, None)
            inst.adapter.meta.pop(abort.req_id, None)
            self.reservations.pop(abort.ticket, None)
            return
        res.aborted = True  # a commit waiting for the engine drops it (see `commit`)
        self._release(abort.ticket)
        self.reservations.pop(abort.ticket, None)
        await self._drop_import(res)

    def _drop_stale(self, ticket: str, res: Reservation) -> None:
        """Free a reservation its source gave up on (as its abort would)."""
        res.aborted = True
        self._release(ticket)
        self.reservations.pop(ticket, None)
        if res.sink is not None:
            self._spawn(self._drop_import(res), f"stale import of {res.offer.req_id}")

    def _release(self, ticket: str) -> None:
        res = self.reservations.get(ticket)
        if res is None or res.released:
            return
        adapter = self.inst.adapter
        adapter.num_reserved_blocks -= res.num_blocks
        adapter.num_incoming -= 1
        res.num_blocks = 0
        res.released = True

    def expire(self) -> None:
        now = time.monotonic()
        for ticket, res in list(self.reservations.items()):
            if res.expires_s < now:
                if not res.committed:
                    log.warning("reservation for %s expired (no commit)", res.offer.req_id)
                    res.aborted = True
                    if res.sink is not None:
                        self._spawn(self._drop_import(res), f"expiry of {res.offer.req_id}")
                self._release(ticket)
                del self.reservations[ticket]

    async def expire_loop(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Expire reservations whose source went silent, also when no new offer comes."""
        self.loop = asyncio.get_running_loop()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            self.expire()
