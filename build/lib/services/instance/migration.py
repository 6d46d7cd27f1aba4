"""Moving a running request, KV included, between instances: both ends of the handshake.

Push migration (an online request after its prefill) and pull migration (an offline decode
a strict instance takes) are one handshake, started by the scheduler's `MigrateCommand` at the
source:

1. source: export the request from its engine (it stops there; its KV bytes are now a payload);
2. source -> target `MigrateOffer` (NATS request/reply): the target reserves KV blocks or refuses;
3. source -> target: the payload over the data plane (direct TCP, size and checksum checked);
4. source -> target `MigrateCommit`: the target imports the request and runs it from now on,
   streaming to the same gateway subject with `seq` continuing;
5. the source forgets it and tells the gateway where it went (a `moved_to` chunk).

An engine that cannot export KV (`--engine sglang`) exports token ids instead: the target
recomputes prompt + generated tokens, and the result says `mode="recompute"`.

Any failure before the commit is answered puts the request back into the source's engine
(`rollback`), so it runs on exactly one instance. A commit whose answer is lost is followed by
a `MigrateAbort`: a target that did start the request drops it again, and one still importing
it when the abort lands drops it as the import ends, never starting it; duplicated chunks this
race could still produce carry a `seq` the gateway has already seen and drops. A target's
reservation that never sees a commit expires (the source died), checked every second: its
blocks are free again, a late commit for it is refused, and the gateway's recompute takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from services.common.bus import respond
from services.instance.dataplane import TransferError, checksum, send_payload
from services.instance.policy_adapter import ReqMeta
from services.instance.worker import Instance, Stream
from tidal.engine.api import SeqSnapshot
from tidal.policy.base import Slo
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    MigrateAbort,
    MigrateCommand,
    MigrateCommit,
    MigrateOffer,
    MigrateOfferReply,
    MigrateResult,
    TokenChunk,
)

log = logging.getLogger("tidal.migration")

OFFER_TIMEOUT_S = 2.0
COMMIT_TIMEOUT_S = 5.0  # the target imports the KV before it answers
RESERVATION_TTL_S = 60.0


@dataclass
class Reservation:
    offer: MigrateOffer
    num_blocks: int
    expires_s: float
    payload: bytes | None = None
    committed: bool = False
    aborted: bool = False  # aborted or expired: a commit in progress must not start it
    released: bool = False  # its blocks and incoming count handed back (once)


class Migrator:
    def __init__(self, instance: Instance) -> None:
        self.inst = instance
        self.reservations: dict[str, Reservation] = {}  # ticket -> reservation
        self.num_bytes_sent = 0
        self.busy: set[str] = set()  # req_ids leaving now
        self.tasks: set[asyncio.Task[None]] = set()  # commands and commits in flight

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        """Run one request's handshake step in a task of its own. NOTE: a subscription hands
        its messages to its callback one at a time; a command waits for the engine lock (a
        step in flight) and then for the target, so commands run in the callback queued
        behind each other: bursts of pushes waited up to 0.6 s on a relaxed instance."""

        async def logged() -> None:
            try:
                await coro
            except Exception:
                log.exception("%s failed", what)

        task = asyncio.create_task(logged())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Wait for the handshakes in flight: a request exported mid-handshake lands on one
        instance (the target, or back here) before the instance stops."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks))

    # ---------------------------------------------------------------- source side

    async def on_command(self, cmd: MigrateCommand, msg: Msg) -> None:
        self._spawn(self._command(cmd, msg), f"migration of {cmd.req_id}")

    async def _command(self, cmd: MigrateCommand, msg: Msg) -> None:
        result = await self.migrate_out(cmd)
        # an engine that cannot move KV (sglang) migrates by recompute; metrics say which
        mode = getattr(self.inst.engine, "migration_mode", "kv")
        result = msgspec.structs.replace(result, mode=mode)
        level = logging.INFO if result.outcome == "ok" else logging.WARNING
        log.log(
            level,
            "%s migration of %s to %s: %s %s",
            cmd.kind,
            cmd.req_id,
            cmd.dst_instance_id,
            result.outcome,
            result.message,
        )
        await respond(msg, result)

    async def migrate_out(self, cmd: MigrateCommand) -> MigrateResult:
        inst, t0 = self.inst, time.perf_counter()
        rid, dst = cmd.req_id, cmd.dst_instance_id
        if rid in self.busy:
            return MigrateResult(rid, "busy", "already migrating")
        stream = inst.streams.get(rid)
        if stream is None or dst == inst.id:
            return MigrateResult(rid, "unknown_request", f"{rid} is not streaming here")
        self.busy.add(rid)
        try:
            async with inst.engine_lock:
                snap = next((s for s in inst.engine.snapshot() if s.req_id == rid), None)
                if snap is None or snap.forced_tokens or snap.status != "running":
                    return MigrateResult(rid, "refused", "not running (or mid-chunk) here")
                data = await asyncio.to_thread(inst.engine.export_request, rid, True)
            meta = inst.adapter.meta.get(rid) or ReqMeta(None, time.time())
            return await self._hand_over(cmd, data, snap, stream, meta, t0)
        finally:
            self.busy.discard(rid)

    async def _hand_over(
        self,
        cmd: MigrateCommand,
        data: bytes,
        snap: SeqSnapshot,
        stream: Stream,
        meta: ReqMeta,
        t0: float,
    ) -> MigrateResult:
        inst, rid, dst = self.inst, cmd.req_id, cmd.dst_instance_id
        digest = checksum(data)
        offer = MigrateOffer(
            req_id=rid,
            src_instance_id=inst.id,
            kind=cmd.kind,
            num_kv_tokens=snap.num_computed_tokens,
            num_bytes=len(data),
            checksum=digest,
            reply_subject=stream.reply_subject,
            next_seq=stream.seq,
            req_class=str(snap.req_class),
            ttft_slo_s=meta.slo.ttft_s if meta.slo else 0.0,
            tpot_slo_s=meta.slo.tpot_s if meta.slo else 0.0,
            arrival_unix_s=meta.arrival_unix_s,
        )
        try:
            msg = await inst.nc.request(
                subjects.migrate_offer(dst), codec.encode(offer), timeout=OFFER_TIMEOUT_S
            )
            reply = codec.decode(msg.data, MigrateOfferReply)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, codec.DecodeError):
            await self.rollback(data)
            return MigrateResult(rid, "failed", f"{dst} did not answer the offer")
        if not reply.ok:
            await self.rollback(data)
            return MigrateResult(rid, "refused", reply.reason)
        try:
            transfer_s = await send_payload(reply.data_url, reply.ticket, data, digest)
        except TransferError as exc:
            await self._abort(dst, rid, reply.ticket, str(exc))
            await self.rollback(data)
            return MigrateResult(rid, "failed", f"data plane: {exc}")
        self.num_bytes_sent += len(data)
        try:
            msg = await inst.nc.request(
                subjects.migrate_commit(dst),
                codec.encode(MigrateCommit(rid, reply.ticket)),
                timeout=COMMIT_TIMEOUT_S,
            )
            done = codec.decode(msg.data, MigrateOfferReply)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, codec.DecodeError):
            done = MigrateOfferReply(ok=False, reason=f"{dst} did not answer the commit")
            await self._abort(dst, rid, reply.ticket, done.reason)
        if not done.ok:
            await self.rollback(data)
            return MigrateResult(rid, "failed", done.reason, len(data), transfer_s)
        # The target runs it now: forget it here and tell the gateway where it went.
        inst.streams.pop(rid, None)
        inst.adapter.meta.pop(rid, None)
        moved = TokenChunk(
            req_id=rid,
            seq=stream.seq,
            text="",
            num_tokens=0,
            num_prompt_tokens=0,
            num_output_tokens=0,
            instance_id=inst.id,
            moved_to=dst,
        )
        await inst.nc.publish(stream.reply_subject, codec.encode(moved))
        inst.wake.set()
        return MigrateResult(rid, "ok", "", len(data), transfer_s, total_s=time.perf_counter() - t0)

    async def rollback(self, data: bytes) -> None:
        """Put an exported request back into this engine (the migration did not happen)."""
        async with self.inst.engine_lock:
            await asyncio.to_thread(self.inst.engine.import_request, data)
        self.inst.wake.set()

    async def _abort(self, dst: str, rid: str, ticket: str, why: str) -> None:
        try:
            await self.inst.nc.publish(
                subjects.migrate_abort(dst), codec.encode(MigrateAbort(rid, ticket, why))
            )
        except Exception as exc:
            log.warning("abort of %s to %s not sent: %s", rid, dst, exc)

    # ---------------------------------------------------------------- target side

    async def on_offer(self, offer: MigrateOffer, msg: Msg) -> None:
        await respond(msg, self.reserve(offer))

    def reserve(self, offer: MigrateOffer) -> MigrateOfferReply:
        inst, adapter = self.inst, self.inst.adapter
        self.expire()
        if inst.draining:
            return MigrateOfferReply(ok=False, reason="draining")
        if offer.req_id in inst.streams or any(
            r.offer.req_id == offer.req_id for r in self.reservations.values()
        ):
            return MigrateOfferReply(ok=False, reason="duplicate")
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

    async def on_payload(self, ticket: str, data: bytes) -> str:
        """Data plane callback: keep the bytes for the commit."""
        res = self.reservations.get(ticket)
        if res is None:
            return "unknown or expired ticket"
        if len(data) != res.offer.num_bytes or checksum(data) != res.offer.checksum:
            return "payload does not match the offer"
        res.payload = data
        return ""

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
        if res.payload is None:
            return MigrateOfferReply(ok=False, reason="no payload arrived")
        self._release(commit.ticket)
        offer = res.offer
        try:
            async with inst.engine_lock:
                if res.aborted:  # the abort landed while this commit waited for the engine
                    return MigrateOfferReply(ok=False, reason="aborted by the source")
                await asyncio.to_thread(inst.engine.import_request, res.payload)
                if res.aborted:
                    # NOTE: the source gave up on this commit while the KV was imported and runs
                    # the request itself again: starting it here would run it twice.
                    inst.engine.abort(offer.req_id)
                    log.warning("migration of %s aborted during its import", offer.req_id)
                    return MigrateOfferReply(ok=False, reason="aborted by the source")
        except (ValueError, MemoryError) as exc:
            return MigrateOfferReply(ok=False, reason=f"import failed: {exc}")
        slo = Slo(offer.ttft_slo_s, offer.tpot_slo_s) if offer.ttft_slo_s > 0 else None
        meta = ReqMeta(slo, offer.arrival_unix_s or time.time())
        meta.num_migrations = 1
        meta.start_unix_s = meta.first_token_unix_s = meta.last_token_unix_s = time.time()
        inst.adapter.meta[offer.req_id] = meta
        inst.streams[offer.req_id] = Stream(offer.reply_subject, offer.next_seq)
        res.committed = True  # kept, committed, so that a late abort finds it
        inst.wake.set()
        return MigrateOfferReply(ok=True, ticket=commit.ticket)

    async def on_abort(self, abort: MigrateAbort, msg: Msg) -> None:
        res = self.reservations.get(abort.ticket)
        if res is None:
            return
        if res.committed:
            # The source did not hear our commit answer and runs the request itself again.
            log.warning("migration of %s aborted after commit: dropping it", abort.req_id)
            inst = self.inst
            async with inst.engine_lock:
                inst.engine.abort(abort.req_id)
            inst.streams.pop(abort.req_id, None)
            inst.adapter.meta.pop(abort.req_id, None)
            self.reservations.pop(abort.ticket, None)
        else:
            res.aborted = True  # a commit importing it now drops it (see `commit`)
            self._release(abort.ticket)
            del self.reservations[abort.ticket]

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
                self._release(ticket)
                del self.reservations[ticket]

    async def expire_loop(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Expire reservations whose source went silent, also when no new offer comes."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            self.expire()
