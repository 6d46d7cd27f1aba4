"""The gateway's side of the bus: route a request, submit it, and stream its tokens back.

One subscription per gateway (`subjects.gateway_tokens(id)`) carries every request's tokens; they
are dispatched by request id to per-request queues and delivered strictly in `seq` order, from
whichever instance runs the request now: a migrated request's chunks come from its new instance
(announced by a `moved_to` chunk), and a chunk whose `seq` was already delivered is dropped. If
the instance running a request dies, the request is routed again elsewhere and recomputed from its
prompt plus the tokens already streamed (`resume_token_ids`): the client sees no repeated text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import subscribe
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import ApiError
from services.gateway.resync import StreamResync
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    BatchStats,
    CancelRequest,
    GenerateAck,
    GenerateRequest,
    Heartbeat,
    InstanceDown,
    InstanceReport,
    MigrationEvent,
    RouteReply,
    RouteRequest,
    TokenChunk,
)

log = logging.getLogger("tidal.gateway")

MAX_ROUTE_ATTEMPTS = 3
MAX_RECOMPUTES = 3  # a request survives this many lost instances
ROUTE_TIMEOUT_S = 2.0  # models and other quick questions
# A route may be held by the policy until it has room (Route.hold); the scheduler answers late.
HELD_ROUTE_TIMEOUT_S = {"online": 30.0, "offline": 600.0}
SUBMIT_TIMEOUT_S = 5.0
ROUTE_RECHECK_S = 0.5  # a held route checks this often whether its scheduler was replaced

_ROUTE_ERRORS = {  # scheduler error code -> HTTP status
    "unknown_model": 404,
    "no_capacity": 503,
    "offline_paused": 503,
    "rejected": 429,  # the policy's admission control
    "queue_full": 429,  # the scheduler's held queue is full
    "invalid_request": 400,
}
# Room left under NATS's max_payload for what a re-placed request adds (resume token ids).
WIRE_HEADROOM_BYTES = 64 * 1024
_ACK_ERRORS = {"context_length_exceeded": 400, "invalid_request": 400}


@dataclass(frozen=True)
class _Down:
    """Queued to a request's stream when its instance dies (or its stream was cut)."""

    instance_id: str
    reason: str
    at_s: float  # monotonic time the notice came in
    exclude: bool = True  # keep the request off that instance (False: the instance is fine)
    alive: bool = False  # the instance still runs the request: cancel it there


@dataclass
class RequestHandle:
    """A submitted request. Iterate it for its `TokenChunk`s, in order, ending with a finish."""

    bus: GatewayBus
    request: GenerateRequest
    instance_id: str = ""
    ack: GenerateAck = field(default_factory=lambda: GenerateAck(ok=False))
    queue: asyncio.Queue[TokenChunk | _Down] = field(default_factory=asyncio.Queue)
    num_chunks: int = 0  # chunks delivered = the next seq expected
    is_finished: bool = False
    early: dict[int, TokenChunk] = field(default_factory=dict)  # seq -> chunk that came early
    token_ids: list[int] = field(default_factory=list)  # streamed so far (for a recompute)
    num_recomputes: int = 0
    num_migrations: int = 0
    placed_at_s: float = 0.0  # monotonic time an instance last accepted it
    reconnects_at_place: int = 0  # the bus's reconnect count when an instance accepted it
    client_req_id: str = ""  # the id the client knows (a re-run copy may have another)

    def __post_init__(self) -> None:
        self.client_req_id = self.client_req_id or self.request.req_id

    async def batches(self) -> AsyncIterator[list[TokenChunk]]:
        """The request's chunks in order, in batches of whatever has arrived: a burst of tokens
        becomes one write to the client instead of one per token."""
        while not self.is_finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch: list[TokenChunk] = []
            for item in items:
                batch += await self._accept(item)
                if self.is_finished:
                    break
            if batch:
                yield batch

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        async for batch in self.batches():
            for chunk in batch:
                yield chunk

    async def _accept(self, item: TokenChunk | _Down) -> list[TokenChunk]:
        if isinstance(item, _Down):
            if item.instance_id != self.instance_id or item.at_s < self.placed_at_s:
                # a stale notice: about an instance this request already left, or about the
                # process that had this id before the one that took the request since
                return []
            return await self._lost(item)
        if item.req_id != self.request.req_id:
            return []
        if item.moved_to:
            if item.seq >= self.num_chunks:  # not a notice older than what we already have
                self.instance_id = item.moved_to
                self.num_migrations += 1
            return []
        if item.seq < self.num_chunks:
            return []  # already delivered (a duplicate after a migration race)
        if item.seq > self.num_chunks and self._reconnected():
            # Chunks are plain NATS messages, in order from one instance: a gap after a bus
            # outage is chunks lost in it, for good. The instance still runs the request, so
            # the stream would wait forever for them: run it again elsewhere from what the
            # client has, under a new id so that what the old copy still sends is dropped.
            why = f"chunks {self.num_chunks}..{item.seq - 1} were lost in a bus outage"
            return await self._lost(_Down(item.instance_id, why, time.monotonic(), alive=True))
        self.early[item.seq] = item
        out: list[TokenChunk] = []
        while self.num_chunks in self.early:
            chunk = self.early.pop(self.num_chunks)
            self.num_chunks += 1
            self.instance_id = chunk.instance_id
            self.token_ids += chunk.token_ids
            out.append(chunk)
            if chunk.finish_reason is not None:
                self.is_finished = True
                self.bus.release(self)
                break
        return out

    def _reconnected(self) -> bool:
        """Has the bus reconnected since an instance last accepted the request?"""
        return bool(self.bus.nc.stats.get("reconnects", 0) != self.reconnects_at_place)

    async def _lost(self, down: _Down) -> list[TokenChunk]:
        """The instance running the request died (or its chunks were lost): run it elsewhere,
        resuming after what the client already has (recompute), or end it with an error if that
        keeps failing."""
        if down.alive:
            await self._abandon(down.reason)
        if self.num_recomputes < MAX_RECOMPUTES:
            self.num_recomputes += 1
            if self.bus.metrics is not None:
                self.bus.metrics.recomputes.labels(self.request.req_class).inc()
            log.warning(
                "request %s lost on %s after %d token(s); recomputing elsewhere",
                self.request.req_id,
                down.instance_id,
                len(self.token_ids),
            )
            self.request = msgspec.structs.replace(
                self.request, resume_token_ids=list(self.token_ids), first_seq=self.num_chunks
            )
            self.early.clear()
            try:
                await self.bus.place(self, exclude=[down.instance_id] if down.exclude else [])
                return []
            except ApiError as exc:
                reason = f"{down.reason}; no instance took it again: {exc.message}"
            except Exception as exc:
                reason = f"{down.reason}; re-routing failed: {exc}"
        else:
            reason = f"{down.reason} ({self.num_recomputes} recomputes already)"
        self.is_finished = True
        self.bus.release(self)
        return [
            TokenChunk(
                req_id=self.request.req_id,
                seq=self.num_chunks,
                text="",
                num_tokens=0,
                num_prompt_tokens=self.ack.num_prompt_tokens,
                num_output_tokens=0,
                instance_id=down.instance_id,
                finish_reason="error",
                error=f"instance {down.instance_id} failed mid-request: {reason}",
            )
        ]

    async def _abandon(self, reason: str) -> None:
        """Cancel the copy that still runs and take a new id for the next one."""
        old = self.request.req_id
        await self.bus.nc.publish(subjects.CANCEL, codec.encode(CancelRequest(old, reason)))
        new = f"{self.client_req_id}.r{self.num_recomputes + 1}"
        self.request = msgspec.structs.replace(self.request, req_id=new)
        self.bus.handles.pop(old, None)
        self.bus.handles[new] = self

    async def cancel(self, reason: str = "client disconnected") -> None:
        if self.is_finished:
            return
        self.is_finished = True
        self.bus.release(self)
        msg = CancelRequest(req_id=self.request.req_id, reason=reason)
        await self.bus.nc.publish(subjects.CANCEL, codec.encode(msg))


class GatewayBus:
    def __init__(
        self, nc: NATS, gateway_id: str, max_inflight: int, metrics: GatewayMetrics | None = None
    ) -> None:
        self.nc = nc
        self.metrics = metrics
        self.gateway_id = gateway_id
        self.reply_subject = subjects.gateway_tokens(gateway_id)
        self.max_inflight = max_inflight
        self.handles: dict[str, RequestHandle] = {}  # req_id -> live request
        self.schedulers_seen: set[tuple[str, float]] = set()  # (id, started) of each process
        self.scheduler_epoch = 0  # +1 each time a new scheduler process appears
        self.resync = StreamResync(nc, self.handles, self._cut)

    async def start(self) -> None:
        await subscribe(self.nc, self.reply_subject, TokenChunk, self._on_chunk)
        await subscribe(self.nc, subjects.INSTANCE_DOWN, InstanceDown, self._on_down)
        beats = f"{subjects.PREFIX}.hb.scheduler.*"
        await subscribe(self.nc, beats, Heartbeat, self._on_scheduler_beat)
        await subscribe(self.nc, subjects.INSTANCE_STATE_ALL, InstanceReport, self._on_rep)
        self.resync.start()
        if self.metrics is not None:
            await subscribe(self.nc, subjects.MIGRATION_EVENTS, MigrationEvent, self._on_mig)
            await subscribe(self.nc, subjects.BATCH_STATS, BatchStats, self._on_batch_stats)

    async def _on_mig(self, ev: MigrationEvent, _: Msg) -> None:
        assert self.metrics is not None
        self.metrics.on_migration(ev)

    async def _on_rep(self, rep: InstanceReport, _: Msg) -> None:
        self.resync.on_report(rep)
        if self.metrics is not None:
            self.metrics.on_report(rep)

    async def _on_batch_stats(self, st: BatchStats, _: Msg) -> None:
        assert self.metrics is not None
        self.metrics.batch.on_stats(st)

    async def _on_chunk(self, chunk: TokenChunk, _: Msg) -> None:
        handle = self.handles.get(chunk.req_id)
        if handle is not None:
            handle.queue.put_nowait(chunk)

    async def _on_down(self, event: InstanceDown, _: Msg) -> None:
        for handle in list(self.handles.values()):
            if handle.instance_id == event.instance_id:
                handle.queue.put_nowait(_Down(event.instance_id, event.reason, time.monotonic()))

    def _cut(self, handle: RequestHandle, reason: str) -> None:
        """A stream that lost its chunks (a bus outage): run it again, anywhere."""
        handle.queue.put_nowait(_Down(handle.instance_id, reason, time.monotonic(), exclude=False))

    def release(self, handle: RequestHandle) -> None:
        self.handles.pop(handle.request.req_id, None)

    async def submit(self, request: GenerateRequest) -> RequestHandle:
        """Route and submit; raises `ApiError` with the right status when it cannot run."""
        if len(self.handles) >= self.max_inflight:
            raise ApiError(
                429,
                f"this gateway already has {self.max_inflight} requests in flight",
                type_="rate_limit_error",
                code="too_many_requests",
                retry_after_s=1,
            )
        self.check_wire(request)
        handle = RequestHandle(bus=self, request=request)
        self.handles[request.req_id] = handle
        try:
            await self.place(handle, exclude=[])
        except BaseException:
            self.release(handle)
            raise
        return handle

    def check_wire(self, request: GenerateRequest) -> None:
        """ApiError unless `request` can go on the bus: MessagePack holds no integer beyond 64
        bits and no lone UTF-16 surrogate (JSON's "\\ud800" decodes to one), and NATS caps a
        message at the server's max_payload (1 MiB by default)."""
        try:
            size = len(codec.encode(request))
        except (OverflowError, UnicodeEncodeError) as exc:
            raise ApiError(400, f"the request cannot be encoded: {exc}") from None
        limit = self.nc.max_payload - WIRE_HEADROOM_BYTES
        if size > limit:
            raise ApiError(
                413,
                f"the request is {size} bytes on the bus, over its limit of {limit} bytes",
                code="request_too_large",
            )

    async def place(self, handle: RequestHandle, exclude: list[str]) -> None:
        """Find an instance that accepts the request, trying others if one does not answer."""
        req = handle.request
        tried = list(exclude)
        failed_at = time.time() if tried else 0.0
        for _ in range(MAX_ROUTE_ATTEMPTS):
            route = await self._route(req, tried, failed_at)
            handle.instance_id = route.instance_id
            try:
                reply = await self.nc.request(
                    subjects.instance_submit(route.instance_id),
                    codec.encode(req),
                    timeout=SUBMIT_TIMEOUT_S,
                )
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                log.warning(
                    "instance %s did not take %s; trying another", route.instance_id, req.req_id
                )
                tried.append(route.instance_id)
                failed_at = time.time()
                continue
            ack = codec.decode(reply.data, GenerateAck)
            if ack.ok:
                if not handle.ack.ok:  # keep the first ack: a recompute's prompt holds outputs
                    handle.ack = ack
                handle.placed_at_s = time.monotonic()
                handle.reconnects_at_place = self.nc.stats.get("reconnects", 0)
                return
            if ack.error_code == "draining":
                tried.append(route.instance_id)
                failed_at = time.time()
                continue
            raise ApiError(
                _ACK_ERRORS.get(ack.error_code, 400), ack.message, code=ack.error_code or None
            )
        raise ApiError(
            503,
            "no instance accepted the request; try again shortly",
            type_="server_error",
            code="no_capacity",
            retry_after_s=1,
        )

    async def _route(
        self, req: GenerateRequest, exclude: list[str], excluded_at_unix_s: float
    ) -> RouteReply:
        ask = RouteRequest(
            req_id=req.req_id,
            model=req.model,
            req_class=req.req_class,
            max_tokens=req.sampling.max_tokens,
            num_prompt_chars=len(req.prompt or "")
            + sum(len(m.content) for m in req.messages or []),
            exclude=exclude,
            excluded_at_unix_s=excluded_at_unix_s,
            ttft_slo_ms=req.ttft_slo_ms,
            tpot_slo_ms=req.tpot_slo_ms,
        )
        msg = await self._ask_route(ask, HELD_ROUTE_TIMEOUT_S.get(req.req_class, ROUTE_TIMEOUT_S))
        route = codec.decode(msg.data, RouteReply)
        if route.error_code:
            status = _ROUTE_ERRORS.get(route.error_code, 503)
            raise ApiError(
                status,
                route.message,
                code=route.error_code,
                type_={404: "invalid_request_error", 400: "invalid_request_error"}.get(
                    status, "rate_limit_error" if status == 429 else "server_error"
                ),
                param="model" if status == 404 else None,
                retry_after_s=route.retry_after_s or None,
            )
        return route

    async def _ask_route(self, ask: RouteRequest, timeout_s: float) -> Msg:
        """The scheduler's answer to `ask`, which may come late (a held request). A request held
        by a scheduler that dies is lost with it: when a new scheduler process appears (its
        first heartbeat), the question is asked again, so a held request never waits forever."""
        data = codec.encode(ask)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        epoch = self.scheduler_epoch
        reconnects = self.nc.stats.get("reconnects", 0)
        try:
            await self.nc.publish(subjects.ROUTE, data, reply=inbox)
            while True:
                left = deadline - loop.time()
                if left <= 0:  # a request held all this time
                    raise ApiError(
                        503,
                        f"no instance took the request within {timeout_s:.0f} s; try again",
                        type_="server_error",
                        code="no_capacity",
                        retry_after_s=1,
                    )
                try:
                    msg = await sub.next_msg(timeout=min(left, ROUTE_RECHECK_S))
                except nats.errors.TimeoutError:
                    if self.scheduler_epoch != epoch:
                        epoch = self.scheduler_epoch
                        log.warning("a new scheduler is up; asking it to route %s", ask.req_id)
                        await self.nc.publish(subjects.ROUTE, data, reply=inbox)
                    elif self.nc.stats.get("reconnects", 0) != reconnects:
                        # the question or its answer may have been lost in a bus outage; the
                        # scheduler answers a request it already holds only once
                        reconnects = self.nc.stats.get("reconnects", 0)
                        log.warning("bus reconnected; asking again to route %s", ask.req_id)
                        await self.nc.publish(subjects.ROUTE, data, reply=inbox)
                    continue
                if msg.headers and msg.headers.get("Status") == "503":  # no responders
                    raise ApiError(
                        503,
                        "the scheduler is not reachable; try again shortly",
                        type_="server_error",
                        code="scheduler_unavailable",
                        retry_after_s=1,
                    )
                return msg
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_scheduler_beat(self, hb: Heartbeat, _: Msg) -> None:
        key = (hb.service_id, hb.started_unix_s)
        if key not in self.schedulers_seen and hb.status != "stopped":
            if self.schedulers_seen:
                self.scheduler_epoch += 1
            self.schedulers_seen.add(key)

    async def models(self) -> list[str]:
        try:
            msg = await self.nc.request(subjects.MODELS, codec.encode({}), timeout=ROUTE_TIMEOUT_S)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            raise ApiError(
                503,
                "the scheduler is not reachable",
                type_="server_error",
                code="scheduler_unavailable",
                retry_after_s=1,
            ) from None
        return codec.decode(msg.data, list[str])
