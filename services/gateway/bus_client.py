"""The gateway's side of the bus: route a request, submit it, and stream its tokens back.

One subscription per gateway (`subjects.gateway_tokens(id)`) carries every request's tokens; they
are dispatched by request id to per-request queues. If the instance running a request dies before
its first token, the request is routed again elsewhere; after that, it ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import subscribe
from services.gateway.protocol import ApiError
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    CancelRequest,
    GenerateAck,
    GenerateRequest,
    InstanceDown,
    RouteReply,
    RouteRequest,
    TokenChunk,
)

log = logging.getLogger("tidal.gateway")

MAX_ROUTE_ATTEMPTS = 3
ROUTE_TIMEOUT_S = 2.0
SUBMIT_TIMEOUT_S = 5.0

_ROUTE_ERRORS = {  # scheduler error code -> HTTP status
    "unknown_model": 404,
    "no_capacity": 503,
    "offline_paused": 503,
}
_ACK_ERRORS = {"context_length_exceeded": 400, "invalid_request": 400}


@dataclass(frozen=True)
class _Down:
    """Queued to a request's stream when its instance dies."""

    instance_id: str
    reason: str


@dataclass
class RequestHandle:
    """A submitted request. Iterate it for its `TokenChunk`s, in order, ending with a finish."""

    bus: GatewayBus
    request: GenerateRequest
    instance_id: str = ""
    ack: GenerateAck = field(default_factory=lambda: GenerateAck(ok=False))
    queue: asyncio.Queue[TokenChunk | _Down] = field(default_factory=asyncio.Queue)
    num_chunks: int = 0
    is_finished: bool = False

    async def batches(self) -> AsyncIterator[list[TokenChunk]]:
        """The request's chunks in order, in batches of whatever has arrived: a burst of tokens
        becomes one write to the client instead of one per token."""
        while not self.is_finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch: list[TokenChunk] = []
            for item in items:
                chunk = await self._accept(item)
                if chunk is not None:
                    batch.append(chunk)
                if self.is_finished:
                    break
            if batch:
                yield batch

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        async for batch in self.batches():
            for chunk in batch:
                yield chunk

    async def _accept(self, item: TokenChunk | _Down) -> TokenChunk | None:
        if isinstance(item, _Down):
            if item.instance_id != self.instance_id:
                return None  # a stale notice about an instance this request already left
            if self.num_chunks == 0:
                log.warning(
                    "request %s lost on %s before its first token; re-routing",
                    self.request.req_id,
                    item.instance_id,
                )
                await self.bus.place(self, exclude=[item.instance_id])
                return None
            self.is_finished = True
            self.bus.release(self)
            return TokenChunk(
                req_id=self.request.req_id,
                seq=self.num_chunks,
                text="",
                num_tokens=0,
                num_prompt_tokens=self.ack.num_prompt_tokens,
                num_output_tokens=0,
                instance_id=item.instance_id,
                finish_reason="error",
                error=f"instance {item.instance_id} failed mid-request: {item.reason}",
            )
        if item.req_id != self.request.req_id or item.instance_id != self.instance_id:
            return None
        self.num_chunks += 1
        if item.finish_reason is not None:
            self.is_finished = True
            self.bus.release(self)
        return item

    async def cancel(self, reason: str = "client disconnected") -> None:
        if self.is_finished:
            return
        self.is_finished = True
        self.bus.release(self)
        msg = CancelRequest(req_id=self.request.req_id, reason=reason)
        await self.bus.nc.publish(subjects.CANCEL, codec.encode(msg))


class GatewayBus:
    def __init__(self, nc: NATS, gateway_id: str, max_inflight: int) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.reply_subject = subjects.gateway_tokens(gateway_id)
        self.max_inflight = max_inflight
        self.handles: dict[str, RequestHandle] = {}  # req_id -> live request

    async def start(self) -> None:
        await subscribe(self.nc, self.reply_subject, TokenChunk, self._on_chunk)
        await subscribe(self.nc, subjects.INSTANCE_DOWN, InstanceDown, self._on_down)

    async def _on_chunk(self, chunk: TokenChunk, _: Msg) -> None:
        handle = self.handles.get(chunk.req_id)
        if handle is not None:
            handle.queue.put_nowait(chunk)

    async def _on_down(self, event: InstanceDown, _: Msg) -> None:
        for handle in list(self.handles.values()):
            if handle.instance_id == event.instance_id:
                handle.queue.put_nowait(_Down(event.instance_id, event.reason))

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
        handle = RequestHandle(bus=self, request=request)
        self.handles[request.req_id] = handle
        try:
            await self.place(handle, exclude=[])
        except BaseException:
            self.release(handle)
            raise
        return handle

    async def place(self, handle: RequestHandle, exclude: list[str]) -> None:
        """Find an instance that accepts the request, trying others if one does not answer."""
        req = handle.request
        tried = list(exclude)
        for _ in range(MAX_ROUTE_ATTEMPTS):
            route = await self._route(req, tried)
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
                continue
            ack = codec.decode(reply.data, GenerateAck)
            if ack.ok:
                handle.ack = ack
                return
            if ack.error_code == "draining":
                tried.append(route.instance_id)
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

    async def _route(self, req: GenerateRequest, exclude: list[str]) -> RouteReply:
        ask = RouteRequest(
            req_id=req.req_id,
            model=req.model,
            req_class=req.req_class,
            max_tokens=req.sampling.max_tokens,
            num_prompt_chars=len(req.prompt or "")
            + sum(len(m.content) for m in req.messages or []),
            exclude=exclude,
        )
        try:
            msg = await self.nc.request(subjects.ROUTE, codec.encode(ask), timeout=ROUTE_TIMEOUT_S)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            raise ApiError(
                503,
                "the scheduler is not reachable; try again shortly",
                type_="server_error",
                code="scheduler_unavailable",
                retry_after_s=1,
            ) from None
        route = codec.decode(msg.data, RouteReply)
        if route.error_code:
            status = _ROUTE_ERRORS.get(route.error_code, 503)
            raise ApiError(
                status,
                route.message,
                code=route.error_code,
                type_="invalid_request_error" if status == 404 else "server_error",
                param="model" if status == 404 else None,
                retry_after_s=route.retry_after_s or None,
            )
        return route

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
