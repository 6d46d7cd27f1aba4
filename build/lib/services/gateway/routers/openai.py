"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Streaming follows OpenAI's SSE format exactly (`data: {chunk}` events, then `data: [DONE]`).
A client that disconnects cancels its request on every instance. Responses from an emulated
engine carry `system_fingerprint: "tidal-sim-emulated"`, an `X-Tidal-Emulated: true` header and
a `tidal.emulated: true` field.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.bus_client import GatewayBus, RequestHandle
from services.gateway.dependencies import get_bus, get_metrics
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    resolve_class_and_slo,
)
from tidal.schemas.messages import GenerateRequest, TokenChunk

router = APIRouter(prefix="/v1")

_DISCONNECT_POLL_S = 0.25
_FAILED = ("error", "abort")


@dataclass
class _Call:
    """One request's bookkeeping: ids, timing and what the client asked for."""

    kind: str  # "chat" | "completion"
    model: str
    req_class: str
    handle: RequestHandle
    metrics: GatewayMetrics
    arrival_s: float
    created: int = field(default_factory=lambda: int(time.time()))
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_output: int = 0

    @property
    def id(self) -> str:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return prefix + self.handle.client_req_id

    @property
    def emulated(self) -> str:
        return "true" if self.handle.ack.is_emulated else "false"

    def envelope(self, chunk: bool = False) -> dict[str, Any]:
        obj = "text_completion"
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "tidal-sim-emulated"
            if self.handle.ack.is_emulated
            else f"tidal-{self.handle.ack.engine}",
        }

    def tidal_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "request_class": self.req_class,
            "instance": self.handle.instance_id,
            "engine": self.handle.ack.engine,
            "emulated": self.handle.ack.is_emulated,
        }
        if self.first_token_s is not None:
            # From the request reaching the gateway to its first token leaving the instance:
            # the server's share of TTFT, without the client's own time.
            info["server_ttft_ms"] = round((self.first_token_s - self.arrival_s) * 1e3, 3)
        return info

    def headers(self) -> dict[str, str]:
        return {
            "X-Tidal-Emulated": self.emulated,
            "X-Tidal-Instance": self.handle.instance_id,
            "X-Tidal-Request-Id": self.handle.client_req_id,
        }

    def observe(self, chunk: TokenChunk) -> None:
        if chunk.num_tokens == 0:
            return
        now = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now
            self.metrics.ttft.labels(self.req_class, self.emulated).observe(now - self.arrival_s)
        self.last_token_s = now
        self.num_output += chunk.num_tokens
        self.metrics.output_tokens.labels(self.req_class, self.emulated).inc(chunk.num_tokens)

    def finish(self) -> None:
        tpot = 0.0
        if self.first_token_s is not None and self.last_token_s is not None and self.num_output > 1:
            tpot = (self.last_token_s - self.first_token_s) / (self.num_output - 1)
            self.metrics.tpot.labels(self.req_class, self.emulated).observe(tpot)
        req = self.handle.request
        if self.req_class == "online" and self.first_token_s is not None:
            ttft_ok = req.ttft_slo_ms is None or (
                (self.first_token_s - self.arrival_s) * 1e3 <= req.ttft_slo_ms
            )
            tpot_ok = req.tpot_slo_ms is None or tpot * 1e3 <= req.tpot_slo_ms
            ok = "true" if ttft_ok and tpot_ok else "false"
            self.metrics.slo.labels(self.req_class, ok, self.emulated).inc()

    def usage(self) -> dict[str, int]:
        prompt = self.handle.ack.num_prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_output,
            "total_tokens": prompt + self.num_output,
        }

    def choice(self, text: str | None, finish: str | None, chunk: TokenChunk | None) -> dict:
        logprobs = _logprobs(self.kind, chunk) if chunk is not None and chunk.logprobs else None
        if self.kind == "chat":
            delta: dict[str, Any] = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


def _logprobs(kind: str, chunk: TokenChunk) -> dict[str, Any]:
    tokens = [chunk.text] if len(chunk.logprobs) == 1 else [""] * len(chunk.logprobs)
    if kind == "chat":
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, chunk.logprobs, strict=True)
            ]
        }
    return {
        "tokens": tokens,
        "token_logprobs": list(chunk.logprobs),
        "top_logprobs": None,
        "text_offset": [],
    }


async def _start(
    kind: str,
    body: ChatCompletionRequest | CompletionRequest,
    request: Request,
    bus: GatewayBus,
    metrics: GatewayMetrics,
) -> _Call:
    """Resolve the request class and SLOs (ApiError on a bad header), then route and submit."""
    req_class, ttft_ms, tpot_ms = resolve_class_and_slo(body, dict(request.headers))
    gen = GenerateRequest(
        req_id=uuid.uuid4().hex,
        model=body.model,
        sampling=body.sampling(),
        reply_subject=bus.reply_subject,
        req_class=req_class,
        prompt=body.prompt_text() if isinstance(body, CompletionRequest) else None,
        messages=body.chat_messages() if isinstance(body, ChatCompletionRequest) else None,
        ttft_slo_ms=ttft_ms,
        tpot_slo_ms=tpot_ms,
        arrival_unix_s=time.time(),
    )
    arrival = getattr(request.state, "arrival_s", time.monotonic())
    handle = await bus.submit(gen)
    return _Call(kind, body.model, req_class, handle, metrics, arrival)


async def _serve(
    kind: str, body: Any, request: Request, bus: GatewayBus, metrics: GatewayMetrics
) -> Any:
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    try:
        call = await _start(kind, body, request, bus, metrics)
    except ApiError as exc:
        # NOTE: a metric label never takes a client's raw value: a rejected request is counted
        # under its class only when that class was valid.
        req_class = body.request_class or request.headers.get("x-tidal-class", "online")
        req_class = req_class.strip().lower()
        label = req_class if req_class in ("online", "offline") else "invalid"
        metrics.requests.labels(label, endpoint, str(exc.status)).inc()
        raise
    metrics.requests.labels(call.req_class, endpoint, "200").inc()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(call, include_usage), media_type="text/event-stream", headers=call.headers()
        )
    return await _complete(call, request)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def _sse_events(call: _Call, chunk: TokenChunk) -> list[bytes]:
    """The SSE events for one token chunk, in OpenAI's format."""
    if chunk.finish_reason in _FAILED:
        error = {
            "message": chunk.error or "request aborted",
            "type": "server_error",
            "code": chunk.finish_reason,
        }
        return [_sse({"error": error})]
    events = []
    if chunk.text or chunk.logprobs:
        events.append(
            _sse(call.envelope(True) | {"choices": [call.choice(chunk.text, None, chunk)]})
        )
    if chunk.finish_reason is not None:
        final = call.choice(None if call.kind == "chat" else "", chunk.finish_reason, None)
        events.append(_sse(call.envelope(True) | {"choices": [final]}))
    return events


async def _stream(call: _Call, include_usage: bool) -> AsyncIterator[bytes]:
    gauge = call.metrics.inflight.labels(call.req_class)
    gauge.inc()
    try:
        if call.kind == "chat":
            role = {"role": "assistant", "content": ""}
            first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
            yield _sse(call.envelope(True) | {"choices": [first]})
        failed = False
        async for batch in call.handle.batches():
            # NOTE: events that arrived together go out in one write; each is still its own
            # `data:` event, so the stream is byte-for-byte OpenAI's format.
            events: list[bytes] = []
            for chunk in batch:
                call.observe(chunk)
                events += _sse_events(call, chunk)
                failed = chunk.finish_reason in _FAILED
            yield b"".join(events)
            if failed:
                break
        call.finish()
        if include_usage and not failed:
            usage = {"choices": [], "usage": call.usage(), "tidal": call.tidal_info()}
            yield _sse(call.envelope(True) | usage)
        yield b"data: [DONE]\n\n"
    finally:
        gauge.dec()
        if not call.handle.is_finished:
            # The client went away mid-stream: cancel everywhere. Shielded, because anyio
            # re-cancels every await inside the cancelled response task.
            call.metrics.cancelled.labels(call.req_class).inc()
            with anyio.CancelScope(shield=True):
                await call.handle.cancel()


async def _complete(call: _Call, request: Request) -> JSONResponse:
    gauge = call.metrics.inflight.labels(call.req_class)
    gauge.inc()
    chunks: list[TokenChunk] = []

    async def collect() -> None:
        async for chunk in call.handle:
            call.observe(chunk)
            chunks.append(chunk)

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                call.metrics.cancelled.labels(call.req_class).inc()
                await call.handle.cancel()
                raise ApiError(499, "client disconnected", code="client_closed_request")
        task.result()
    finally:
        gauge.dec()
        if not task.done():
            task.cancel()
    call.finish()
    last = chunks[-1] if chunks else None
    if last is None or last.finish_reason in _FAILED:
        reason = last.error if last is not None else "no output"
        raise ApiError(
            502, f"generation failed: {reason}", type_="server_error", code="generation_failed"
        )
    text = "".join(c.text for c in chunks)
    lps = [lp for c in chunks for lp in c.logprobs]
    merged = (
        TokenChunk(
            req_id="",
            seq=0,
            text=text,
            num_tokens=0,
            num_prompt_tokens=0,
            num_output_tokens=0,
            instance_id="",
            logprobs=lps,
        )
        if lps
        else None
    )
    if call.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": _logprobs("chat", merged) if merged else None,
            "finish_reason": last.finish_reason,
        }
    else:
        choice = call.choice(text, last.finish_reason, merged)
    body = call.envelope() | {
        "choices": [choice],
        "usage": call.usage(),
        "tidal": call.tidal_info(),
    }
    return JSONResponse(body, headers=call.headers())


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    bus: GatewayBus = Depends(get_bus),
    metrics: GatewayMetrics = Depends(get_metrics),
) -> Any:
    return await _serve("chat", body, request, bus, metrics)


@router.post("/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    bus: GatewayBus = Depends(get_bus),
    metrics: GatewayMetrics = Depends(get_metrics),
) -> Any:
    return await _serve("completion", body, request, bus, metrics)


@router.get("/models")
async def list_models(bus: GatewayBus = Depends(get_bus)) -> dict[str, Any]:
    names = await bus.models()
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": 0, "owned_by": "tidal"} for n in names],
    }
