"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Streaming follows OpenAI's SSE format exactly (`data: {chunk}` events, then `data: [DONE]`).
A client that disconnects cancels its request on every instance. `n` > 1 runs `n` requests
(seeds `seed`, `seed + 1`, ... when a seed is given) and merges their choices by `index`.
Responses from an emulated
engine carry `system_fingerprint: "tidal-sim-emulated"`, an `X-Tidal-Emulated: true` header and
a `tidal.emulated: true` field.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.client.stream import RequestHandle
from services.common.protocol import (
    SEED_MAX,
    SEED_MIN,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    asked_class,
    resolve_class_and_slo,
)
from services.gateway.bus import GatewayBus
from services.gateway.call import FAILED, Call, usage
from services.gateway.dependencies import get_bus, get_classes, get_metrics, get_owner
from services.gateway.metrics import GatewayMetrics
from tidal.config.classes import RequestClassSpec
from tidal.schemas.messages import GenerateRequest, TokenChunk

router = APIRouter(prefix="/v1")

_DISCONNECT_POLL_S = 0.25


def _seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: `seed + index`, wrapped into int64."""
    if seed is None:
        return None
    return (seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN


# The scheduler's refusals a looser class may take (its other errors say nothing of the class).
_DEMOTABLE = ("rejected", "queue_full")


async def _start(
    kind: str,
    body: ChatCompletionRequest | CompletionRequest,
    request: Request,
    bus: GatewayBus,
    metrics: GatewayMetrics,
) -> list[Call]:
    """Refuse what cannot be honoured, resolve the request class and SLOs (ApiError on a bad
    header or class), then route and submit each of the `n` choices: in the class asked, else
    in the first looser class of its demotion chain that takes it (docs/classes.md); 429 when
    none does."""
    if (refusal := body.unsupported()) is not None:
        raise refusal
    table = get_classes(request)
    asked, ttft_ms, tpot_ms = resolve_class_and_slo(
        body, dict(request.headers), table, get_owner(request)
    )
    refused: ApiError | None = None
    for spec in table.chain(asked):
        if spec.queue_bound is not None and not table.has_room(spec, bus.in_flight(spec.name)):
            refused = ApiError(
                429,
                f"request class {spec.name} has {spec.queue_bound} requests in flight, its bound",
                type_="rate_limit_error",
                code="class_full",
                retry_after_s=1,
            )
            continue
        own = spec is asked  # the request's own SLO holds in the class it asked for only
        try:
            response_id, handles = await _submit(
                body, bus, spec, ttft_ms if own else None, tpot_ms if own else None
            )
        except ApiError as exc:
            if exc.status != 429 or exc.code not in _DEMOTABLE:
                raise
            refused = exc
            continue
        demoted_from = "" if own else asked.name
        if demoted_from:
            metrics.demotions.labels(asked.name, spec.name).inc()
        arrival = getattr(request.state, "arrival_s", time.monotonic())
        return [
            Call(
                kind,
                body.model,
                spec.name,
                h,
                metrics,
                arrival,
                index=i,
                response_id=response_id,
                demoted_from=demoted_from,
            )
            for i, h in enumerate(handles)
        ]
    assert refused is not None
    metrics.class_rejections.labels(asked.name).inc()
    raise refused


async def _submit(
    body: ChatCompletionRequest | CompletionRequest,
    bus: GatewayBus,
    spec: RequestClassSpec,
    ttft_ms: float | None,
    tpot_ms: float | None,
) -> tuple[str, list[RequestHandle]]:
    """Route and submit the `n` choices in class `spec`, all or none: (response id, handles)."""
    response_id = uuid.uuid4().hex
    sampling = body.sampling()
    gens = [
        GenerateRequest(
            req_id=response_id if body.n == 1 else f"{response_id}-{i}",
            model=body.model,
            sampling=msgspec.structs.replace(sampling, seed=_seed(sampling.seed, i)),
            reply_subject=bus.reply_subject,
            req_class=spec.kind.value,
            prompt=body.prompt_text() if isinstance(body, CompletionRequest) else None,
            messages=body.chat_messages() if isinstance(body, ChatCompletionRequest) else None,
            ttft_slo_ms=ttft_ms or spec.ttft_ms,
            tpot_slo_ms=tpot_ms or spec.tpot_ms,
            arrival_unix_s=time.time(),
            class_name=spec.name,
            priority=spec.priority,
            slo_admission=spec.slo_admission,
        )
        for i in range(body.n)
    ]
    results = await asyncio.gather(*(bus.submit(g) for g in gens), return_exceptions=True)
    handles = [r for r in results if isinstance(r, RequestHandle)]
    failed = [r for r in results if not isinstance(r, RequestHandle)]
    if failed:
        for h in handles:  # all choices or none
            await h.cancel("another choice of the request failed")
        raise failed[0]
    return response_id, handles


async def _serve(
    kind: str, body: Any, request: Request, bus: GatewayBus, metrics: GatewayMetrics
) -> Any:
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    try:
        calls = await _start(kind, body, request, bus, metrics)
    except ApiError as exc:
        # NOTE: a metric label never takes a client's raw value: a rejected request is counted
        # under its class only when that class was valid.
        asked = asked_class(body, dict(request.headers))
        table = get_classes(request)
        label = asked if asked in table.names else "invalid" if asked else table.default_name
        metrics.requests.labels(label, endpoint, str(exc.status)).inc()
        raise
    metrics.requests.labels(calls[0].req_class, endpoint, "200").inc()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(calls, include_usage)
        headers = calls[0].headers()
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return await _complete(calls, request)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def _sse_events(call: Call, chunk: TokenChunk) -> list[bytes]:
    """The SSE events for one token chunk, in OpenAI's format."""
    if chunk.finish_reason in FAILED:
        error = {
            "message": chunk.error or "request aborted",
            "type": "server_error",
            "code": chunk.finish_reason,
        }
        return [_sse({"error": error})]
    events = []
    if chunk.text or chunk.logprobs:
        events.append(
            _sse(call.envelope(True) | {"choices": [call.choice(chunk.text, None, [chunk])]})
        )
    if chunk.finish_reason is not None:
        final = call.choice(None if call.kind == "chat" else "", chunk.finish_reason, [])
        events.append(_sse(call.envelope(True) | {"choices": [final]}))
    return events


async def _merged(calls: list[Call]) -> AsyncIterator[tuple[Call, list[TokenChunk]]]:
    """Each call's batches of chunks as they arrive, from all calls at once."""
    if len(calls) == 1:  # no task hop for the common case
        async for batch in calls[0].handle.batches():
            yield calls[0], batch
        return
    queue: asyncio.Queue[tuple[Call, list[TokenChunk] | None]] = asyncio.Queue()

    async def pump(call: Call) -> None:
        try:
            async for got in call.handle.batches():
                queue.put_nowait((call, got))
        finally:
            queue.put_nowait((call, None))

    tasks = [asyncio.create_task(pump(c)) for c in calls]
    try:
        left = len(calls)
        while left:
            which, item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield which, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(calls: list[Call], include_usage: bool) -> AsyncIterator[bytes]:
    first = calls[0]
    gauge = first.metrics.inflight.labels(first.req_class)
    gauge.inc()
    reasons: dict[int, str | None] = {c.index: None for c in calls}
    try:
        if first.kind == "chat":
            for call in calls:
                role = {"role": "assistant", "content": ""}
                opening = {"index": call.index, "delta": role, "logprobs": None}
                yield _sse(call.envelope(True) | {"choices": [opening | {"finish_reason": None}]})
        failed = False
        async for call, batch in _merged(calls):
            # NOTE: events that arrived together go out in one write; each is still its own
            # `data:` event, so the stream is byte-for-byte OpenAI's format.
            events: list[bytes] = []
            for chunk in batch:
                call.observe(chunk)
                events += _sse_events(call, chunk)
                failed = failed or chunk.finish_reason in FAILED
                reasons[call.index] = chunk.finish_reason or reasons[call.index]
            yield b"".join(events)
            if failed:
                break
        for call in calls:
            call.finish(reasons[call.index])
        if include_usage and not failed:
            body = {"choices": [], "usage": usage(calls), "tidal": first.tidal_info()}
            yield _sse(first.envelope(True) | body)
        yield b"data: [DONE]\n\n"
    finally:
        gauge.dec()
        unfinished = [c for c in calls if not c.handle.is_finished]
        if unfinished:
            # The client went away mid-stream (or a choice failed): cancel everywhere.
            # Shielded, because anyio re-cancels every await inside the cancelled response task.
            first.metrics.cancelled.labels(first.req_class).inc()
            with anyio.CancelScope(shield=True):
                for call in unfinished:
                    await call.handle.cancel()


async def _complete(calls: list[Call], request: Request) -> JSONResponse:
    first = calls[0]
    gauge = first.metrics.inflight.labels(first.req_class)
    gauge.inc()
    chunks: dict[int, list[TokenChunk]] = {c.index: [] for c in calls}

    async def collect(call: Call) -> None:
        async for chunk in call.handle:
            call.observe(chunk)
            chunks[call.index].append(chunk)

    tasks = {asyncio.create_task(collect(c)) for c in calls}
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=_DISCONNECT_POLL_S)
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                first.metrics.cancelled.labels(first.req_class).inc()
                for call in calls:
                    await call.handle.cancel()
                raise ApiError(499, "client disconnected", code="client_closed_request")
        for t in tasks:
            t.result()
    finally:
        gauge.dec()
        for t in tasks:
            if not t.done():
                t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
    choices = []
    for call in calls:
        got = chunks[call.index]
        last = got[-1] if got else None
        call.finish(last.finish_reason if last is not None else None)
        if last is None or last.finish_reason in FAILED:
            reason = last.error if last is not None else "no output"
            raise ApiError(
                502, f"generation failed: {reason}", type_="server_error", code="generation_failed"
            )
        text = "".join(c.text for c in got)
        if call.kind == "chat":
            lps = call.logprobs(got) if any(c.logprobs for c in got) else None
            choices.append(
                {
                    "index": call.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lps,
                    "finish_reason": last.finish_reason,
                }
            )
        else:
            choices.append(call.choice(text, last.finish_reason, got))
    body = first.envelope() | {
        "choices": choices,
        "usage": usage(calls),
        "tidal": first.tidal_info(),
    }
    return JSONResponse(body, headers=first.headers())


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
