"""Moving a running request, KV included, between instances: both ends of the handshake.

Push migration (an online request after its prefill) and pull migration (an offline decode
a strict instance takes) are one handshake, started by the scheduler's `MigrateCommand` at the
source:

1. source: `begin_export` - the request stops being scheduled there but keeps its KV blocks;
2. source -> target `MigrateOffer` (NATS request/reply): the target reserves KV blocks or refuses;
3. source -> target over the data plane (`dataplane.py`, direct TCP, off the event loop): the
   request's state, then its KV streamed in checksummed chunks from the source's blocks into the
   target's (`begin_import` reserves them when the state arrives);
4. source -> target `MigrateCommit`: the target's `end_import` makes the request its own, and it
   streams to the same gateway subject with `seq` continuing;
5. the source's `end_export(moved=True)` frees its blocks; it tells the gateway where the
   request went (a `moved_to` chunk).

An engine that cannot export KV (`--engine sglang`) exports token ids instead
(`WholeRequestMover`): the target recomputes prompt + generated tokens, and the result says
`mode="recompute"`.

Any failure before the commit is answered ends the export with `moved=False`: the request runs on
at the source from its own KV blocks, which never left (nothing is re-imported, so nothing can
fail for lack of memory), and it runs on exactly one instance. A commit whose answer is lost is
followed by a `MigrateAbort`: a target that did start the request drops it again, and one whose
commit still waits for its engine never starts it; duplicated chunks this race could still
produce carry a `seq` the gateway has already seen and drops. A target's
reservation that never sees a commit expires (the source died), checked every second: its
blocks are free again, a late commit for it is refused, and the gateway's recompute takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from services.common.bus import respond
from services.instance.dataplane import TransferError, send_kv
from services.instance.migration_in import Importer, Reservation
from services.instance.policy_adapter import ReqMeta
from services.instance.worker import Instance, Stream
from tidal.engine.api import SeqSnapshot
from tidal.engine.migrate import KvSource, MovableEngine, WholeRequestMover
from tidal.plan import MigrationMode
from tidal.policy.state import Phase
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    MigrateAbort,
    MigrateCommand,
    MigrateCommit,
    MigrateOffer,
    MigrateOfferReply,
    MigrateResult,
    ReqReport,
    TokenChunk,
)

log = logging.getLogger("tidal.migration")

OFFER_TIMEOUT_S = 2.0
COMMIT_TIMEOUT_S = 5.0


def mover_of(engine: Any) -> MovableEngine:
    """The engine itself when it moves KV (its capabilities say so); token ids otherwise, in
    one buffer (the target recomputes)."""
    if engine.capabilities.migration is MigrationMode.KV:
        return engine  # type: ignore[no-any-return]
    return WholeRequestMover(engine)


class Migrator(Importer):
    """Both ends of the handshake: the source side here, the target side in `Importer`."""

    loop: asyncio.AbstractEventLoop | None = None

    def __init__(self, instance: Instance) -> None:
        self.inst = instance
        self.mover = mover_of(instance.engine)
        self.reservations: dict[str, Reservation] = {}  # ticket -> reservation
        self.num_bytes_sent = 0
        self.busy: set[str] = set()  # req_ids leaving now
        self.tasks: set[asyncio.Task[None]] = set()  # commands and commits in flight
        # for the data plane's threads (built on the loop; a unit test may build it off one)
        with contextlib.suppress(RuntimeError):
            self.loop = asyncio.get_running_loop()

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
        mode = self.inst.engine.capabilities.migration
        result = msgspec.structs.replace(result, mode=str(mode))
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
            if stream is None:
                await self._drop_orphan(rid)
            return MigrateResult(rid, "unknown_request", f"{rid} is not streaming here")
        self.busy.add(rid)
        try:
            async with inst.engine_lock:
                snap = next((s for s in inst.engine.snapshot() if s.req_id == rid), None)
                if snap is None or snap.forced_tokens or snap.status != "running":
                    return MigrateResult(rid, "refused", "not running (or mid-chunk) here")
                source = await self.inst.compute.run(self.mover.begin_export, rid)
                # what it held back goes out first: the target's chunks continue from this seq
                await inst.flush(rid)
            meta = inst.adapter.meta.get(rid) or ReqMeta(None, time.time())
            inst.moving_out[rid] = ReqReport(
                rid,
                str(snap.req_class),
                Phase.MIGRATING.value,
                meta.arrival_unix_s,
                snap.num_prompt_tokens,
                snap.max_output_tokens,
                snap.num_computed_tokens,
                snap.num_output_tokens,
                snap.num_blocks,
            )
            moved = False
            try:
                result = await self._hand_over(cmd, source, snap, stream, meta, t0)
                moved = result.outcome == "ok"
            finally:  # also when cancelled: the request runs on exactly one instance
                await self._end_export(rid, moved)
                inst.moving_out.pop(rid, None)
            if moved:
                await self._announce_moved(rid, stream, dst)
            return result
        finally:
            self.busy.discard(rid)

    def _drop_streamless(self, rid: str, why: str) -> None:
        """Abort a request the engine holds with no stream here (its client's copy was
        cancelled and re-run elsewhere while a link was cut): nobody reads its tokens. The
        caller holds the engine lock."""
        if rid not in self.inst.streams and self.inst.engine.abort(rid):
            self.inst.adapter.meta.pop(rid, None)
            log.warning("%s %s; dropped", rid, why)

    async def _drop_orphan(self, rid: str) -> None:
        async with self.inst.engine_lock:
            self._drop_streamless(rid, "ran here with no stream (an orphan)")
        self.inst.wake.set()

    async def _end_export(self, rid: str, moved: bool) -> None:
        async with self.inst.engine_lock:
            await self.inst.compute.run(self.mover.end_export, rid, moved)
            if not moved:
                # NOTE: cancelled while it was out for export: the abort found nothing to
                # abort then, and taking the export back would run it here, streaming to no one
                self._drop_streamless(rid, "was cancelled during its export")
        self.inst.wake.set()

    async def _hand_over(
        self,
        cmd: MigrateCommand,
        source: KvSource,
        snap: SeqSnapshot,
        stream: Stream,
        meta: ReqMeta,
        t0: float,
    ) -> MigrateResult:
        inst, rid, dst = self.inst, cmd.req_id, cmd.dst_instance_id
        num_bytes = source.num_tokens * source.bytes_per_token
        offer = MigrateOffer(
            req_id=rid,
            src_instance_id=inst.id,
            kind=cmd.kind,
            num_kv_tokens=snap.num_computed_tokens,
            num_bytes=num_bytes,
            reply_subject=stream.reply_subject,
            next_seq=stream.seq,
            req_class=str(snap.req_class),
            ttft_slo_s=meta.slo.ttft_s if meta.slo else 0.0,
            tpot_slo_s=meta.slo.tpot_s if meta.slo else 0.0,
            arrival_unix_s=meta.arrival_unix_s,
            first_token_unix_s=meta.first_token_unix_s or 0.0,
        )
        try:
            msg = await inst.nc.request(
                subjects.migrate_offer(dst), codec.encode(offer), timeout=OFFER_TIMEOUT_S
            )
            reply = codec.decode(msg.data, MigrateOfferReply)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, codec.DecodeError):
            return MigrateResult(rid, "failed", f"{dst} did not answer the offer")
        if not reply.ok:
            return MigrateResult(rid, "refused", reply.reason)
        try:
            transfer_s = await send_kv(reply.data_url, reply.ticket, source)
        except TransferError as exc:
            await self._abort(dst, rid, reply.ticket, str(exc))
            return MigrateResult(rid, "failed", f"data plane: {exc}")
        self.num_bytes_sent += num_bytes
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
            return MigrateResult(rid, "failed", done.reason, num_bytes, transfer_s)
        return MigrateResult(rid, "ok", "", num_bytes, transfer_s, total_s=time.perf_counter() - t0)

    async def _announce_moved(self, rid: str, stream: Stream, dst: str) -> None:
        """The target runs it now: forget it here and tell the gateway where it went."""
        inst = self.inst
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

    async def _abort(self, dst: str, rid: str, ticket: str, why: str) -> None:
        try:
            await self.inst.nc.publish(
                subjects.migrate_abort(dst), codec.encode(MigrateAbort(rid, ticket, why))
            )
        except Exception as exc:
            log.warning("abort of %s to %s not sent: %s", rid, dst, exc)
