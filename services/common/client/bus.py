"""The cluster's request client (the gateway's and the Batch API service's side of the bus):
route a request, submit it, and stream its tokens back.

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

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import subscribe
from services.common.client.resync import StreamResync
from services.common.client.silence import Silences
from services.common.client.stream import RequestHandle, _Down
from services.common.protocol import ApiError
from tidal import envs
from tidal.cluster.membership import Membership
from tidal.policy.state import Slo
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    CancelRequest,
    GenerateAck,
    GenerateRequest,
    Heartbeat,
    InstanceDown,
    InstanceReport,
    RouteReply,
    RouteRequest,
    TokenChunk,
)

log = logging.getLogger("tidal.gateway")

MAX_ROUTE_ATTEMPTS = 3
ROUTE_TIMEOUT_S = 2.0  # models and other quick questions
# A route may be held by the policy until it has room (Route.hold); the scheduler answers late,
# within its max hold (`TIDAL_MAX_HOLD_S`, one setting for both): the gateway waits that long and
# a little more, so the scheduler's own answer (429 "held longer than ...") arrives first.
HOLD_MARGIN_S = 5.0
SUBMIT_TIMEOUT_S = 5.0
UNTIL_HEARD_S = 10.0  # a submit waits this long for its silent instance to be heard again
MAX_RELINKS = 3  # submits sent again to an instance whose link was just back
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


class RequestBus:
    """Requests placed and streamed for one client of the cluster (a gateway, the batch service).
    The `saw_*` and `on_recompute` hooks do nothing here; the gateway's bus feeds its metrics
    from them (`services/gateway/bus.py`)."""

    def __init__(self, nc: NATS, gateway_id: str, max_inflight: int) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.reply_subject = subjects.gateway_tokens(gateway_id)
        self.max_inflight = max_inflight
        self.handles: dict[str, RequestHandle] = {}  # req_id -> live request
        self.schedulers_seen: set[tuple[str, float]] = set()  # (id, started) of each process
        self.scheduler_epoch = 0  # +1 each time a new scheduler process appears
        self.resync = StreamResync(nc, self.handles, self._cut)
        # Instances and schedulers heard from lately, for `/ready` (as the scheduler counts a
        # service gone after 4 missed beats).
        self.presence = Membership(timeout_s=4 * envs.heartbeat_s())
        self.silences = Silences(envs.heartbeat_s(), self.resync.check_soon)

    async def start(self) -> None:
        await subscribe(self.nc, self.reply_subject, TokenChunk, self._on_chunk)
        await subscribe(self.nc, subjects.INSTANCE_DOWN, InstanceDown, self._on_down)
        beats = f"{subjects.PREFIX}.hb.scheduler.*"
        await subscribe(self.nc, beats, Heartbeat, self._on_scheduler_beat)
        await subscribe(self.nc, subjects.INSTANCE_STATE_ALL, InstanceReport, self._on_rep)
        self.resync.start()
        instances = f"{subjects.PREFIX}.hb.instance.*"
        await subscribe(self.nc, instances, Heartbeat, self._on_instance_beat)

    # ---- hooks (the gateway's metrics) ----

    def saw_report(self, rep: InstanceReport) -> None:
        """An instance's report came in."""

    def saw_instance_beat(self, hb: Heartbeat) -> None:
        """An instance's heartbeat came in."""

    def saw_scheduler_beat(self, hb: Heartbeat) -> None:
        """A scheduler's heartbeat came in."""

    def saw_down(self, instance_id: str) -> None:
        """The scheduler declared `instance_id` dead."""

    def on_recompute(self, req_class: str) -> None:
        """A stream lost its instance and runs again elsewhere."""

    # ---- the bus ----

    async def _on_rep(self, rep: InstanceReport, _: Msg) -> None:
        self.silences.heard(rep.instance_id)
        self.resync.on_report(rep)
        for rid in self.silences.still_running(rep):
            log.warning("%s still runs abandoned %s; cancelling it again", rep.instance_id, rid)
            cancel = CancelRequest(rid, "abandoned for a re-run after a cut")
            await self.nc.publish(subjects.CANCEL, codec.encode(cancel))
        self.saw_report(rep)

    async def _on_instance_beat(self, hb: Heartbeat, _: Msg) -> None:
        self.silences.heard(hb.service_id)
        self._observe(hb)
        self.saw_instance_beat(hb)

    def _observe(self, hb: Heartbeat) -> None:
        if hb.status == "stopped":
            self.presence.forget(hb.kind, hb.service_id)
        else:
            self.presence.observe(hb, time.monotonic())

    async def _on_chunk(self, chunk: TokenChunk, _: Msg) -> None:
        handle = self.handles.get(chunk.req_id)
        if handle is not None:
            handle.queue.put_nowait(chunk)

    async def _on_down(self, event: InstanceDown, _: Msg) -> None:
        self.saw_down(event.instance_id)
        for handle in list(self.handles.values()):
            if handle.instance_id == event.instance_id:
                handle.queue.put_nowait(_Down(event.instance_id, event.reason, time.monotonic()))

    def _cut(self, handle: RequestHandle, reason: str) -> None:
        """A stream that lost its chunks (a bus outage): run it again, anywhere."""
        handle.queue.put_nowait(_Down(handle.instance_id, reason, time.monotonic(), exclude=False))

    def in_flight(self, class_name: str) -> int:
        """Requests (choices) of request class `class_name` this client has in flight."""
        return sum(1 for h in self.handles.values() if h.request.class_name == class_name)

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

    async def place(
        self, handle: RequestHandle, exclude: list[str], excluded_at_unix_s: float = 0.0
    ) -> None:
        """Find an instance that accepts the request, trying others if one does not answer.
        `exclude`: instances whose processes started at or before `excluded_at_unix_s` (the ones
        that failed it); a process started since under the same id may take it."""
        req = handle.request
        tried = list(exclude)
        failed_at = (excluded_at_unix_s or time.time()) if tried else 0.0
        # NOTE: the gateway does not tokenise, so a first placement routes on characters (the
        # scheduler divides them); a re-placement knows the prompt's tokens from the first ack.
        known = handle.ack.num_prompt_tokens + len(req.resume_token_ids) if handle.ack.ok else 0
        failures = 0
        while failures < MAX_ROUTE_ATTEMPTS:
            route = await self._route(req, tried, failed_at, known)
            handle.instance_id = route.instance_id
            if route.default_ttft_slo_s > 0 and route.default_tpot_slo_s > 0:
                handle.default_slo = Slo(route.default_ttft_slo_s, route.default_tpot_slo_s)
            # NOTE: the process the scheduler routed to is the one that fails it (its start time,
            # else the time it was sent), not the time the failure shows: the instance's process
            # restarted meanwhile (`tidal up` restarts it in seconds; the submit times out in 5)
            # did not fail it, and excluding it kept the request held until the gateway gave up.
            incarnation = route.instance_started_unix_s or time.time()
            try:
                reply = await self._submit(req, route.instance_id)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                failures += 1
                log.warning(
                    "instance %s did not take %s; trying another", route.instance_id, req.req_id
                )
                tried.append(route.instance_id)
                failed_at = max(failed_at, incarnation)
                continue
            ack = codec.decode(reply.data, GenerateAck)
            if ack.ok:
                if not handle.ack.ok:  # keep the first ack: a recompute's prompt holds outputs
                    handle.ack = ack
                handle.placed_at_s = time.monotonic()
                handle.placed_at_unix_s = incarnation
                handle.progress_unix_s = time.time()
                handle.reconnects_at_place = self.nc.stats.get("reconnects", 0)
                return
            if ack.error_code not in _ACK_ERRORS:
                # draining, a duplicate of a re-placement, anything not the client's fault:
                # another instance, then 503 with Retry-After below (never a 400)
                log.warning(
                    "instance %s refused %s: %s %s",
                    route.instance_id,
                    req.req_id,
                    ack.error_code,
                    ack.message,
                )
                tried.append(route.instance_id)
                failed_at = max(failed_at, incarnation)
                failures += 1
                continue
            raise ApiError(_ACK_ERRORS[ack.error_code], ack.message, code=ack.error_code)
        raise ApiError(
            503,
            "no instance accepted the request; try again shortly",
            type_="server_error",
            code="no_capacity",
            retry_after_s=1,
        )

    async def _submit(self, req: GenerateRequest, instance_id: str) -> Msg:
        """Send `req` to `instance_id`, again if it met a link just back (at most
        `MAX_RELINKS` times); raises NATS's no-responders or timeout error when it failed."""
        for relink in range(MAX_RELINKS + 1):
            # an instance this gateway cannot hear (its link or ours cut) would not hear it;
            # one still unheard after `UNTIL_HEARD_S` failed it (another instance is tried)
            if not await self.silences.until_heard(instance_id, UNTIL_HEARD_S):
                raise nats.errors.TimeoutError
            sent_s = time.monotonic()
            try:
                return await self.nc.request(
                    subjects.instance_submit(instance_id),
                    codec.encode(req),
                    timeout=SUBMIT_TIMEOUT_S,
                )
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if relink == MAX_RELINKS or not self.silences.was_cut_around(instance_id, sent_s):
                    raise
                # NOTE: not the instance's failure: excluding it held a re-run copy whose only
                # fit it was until the scheduler's max hold, then failed the stream (an
                # instance that got the first copy acks this one as it did that)
                log.warning(
                    "%s did not reach %s across a link just back; sending it again",
                    req.req_id,
                    instance_id,
                )
        raise AssertionError("unreachable")

    async def _route(
        self,
        req: GenerateRequest,
        exclude: list[str],
        excluded_at_unix_s: float,
        num_prompt_tokens: int = 0,
    ) -> RouteReply:
        ask = RouteRequest(
            req_id=req.req_id,
            model=req.model,
            req_class=req.req_class,
            max_tokens=req.sampling.max_tokens,
            max_tokens_is_default=req.sampling.max_tokens_is_default,
            num_prompt_chars=len(req.prompt or "")
            + sum(len(m.content) for m in req.messages or []),
            exclude=exclude,
            excluded_at_unix_s=excluded_at_unix_s,
            ttft_slo_ms=req.ttft_slo_ms,
            tpot_slo_ms=req.tpot_slo_ms,
            num_prompt_tokens=num_prompt_tokens,
            class_name=req.class_name,
            priority=req.priority,
            slo_admission=req.slo_admission,
        )
        msg = await self._ask_route(ask, envs.max_hold_s() + HOLD_MARGIN_S)
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
        self._observe(hb)
        self.saw_scheduler_beat(hb)
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
