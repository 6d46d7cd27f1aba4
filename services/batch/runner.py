"""Run one batch line in the cluster as an offline request, and build its response body.

The line's body is the same JSON a client posts to `/v1/chat/completions` or `/v1/completions`,
checked by the gateway's own request models; it is routed with `req_class="offline"`, so the
policy decides when it runs (`Route.hold` keeps it in the scheduler's queue until there is
slack). The body returned is the one the gateway returns for a non-streaming request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from services.common.client.bus import RequestBus
from services.common.client.stream import RequestHandle
from services.common.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from tidal.config.classes import RequestClassSpec
from tidal.schemas.messages import GenerateRequest, TokenChunk

_FAILED = ("error", "abort")
# The cluster is busy or restarting: run the line again later. A 404 for the model is one too:
# the batch was validated against the models served then, so the model is (re)starting.
RETRY_STATUSES = (404, 429, 503)


@dataclass(frozen=True)
class Outcome:
    """What became of one line: an HTTP-like status and body, or `retry` (not a result)."""

    status_code: int
    body: dict[str, Any]
    request_id: str
    retry: bool = False
    output_tokens: int = 0


def build_request(
    endpoint: str, body: dict[str, Any], reply_subject: str, lane: RequestClassSpec | None = None
) -> GenerateRequest:
    """The offline `GenerateRequest` for a line's body, in request class `lane` (the lowest
    class, best effort; default the built-in `offline`); ApiError(400) when the body is
    invalid."""
    model_type = ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest
    try:
        req: ChatCompletionRequest | CompletionRequest = model_type.model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"{where}: {first.get('msg', 'invalid')}", param=where) from None
    if req.stream:
        raise ApiError(400, "streaming is not available in a batch", param="stream")
    if (refusal := req.unsupported()) is not None:
        raise refusal
    if req.n != 1:
        raise ApiError(400, "n > 1 is not available in a batch line", param="n")
    wants_logprobs = (
        req.logprobs if isinstance(req, ChatCompletionRequest) else req.logprobs is not None
    )
    if wants_logprobs:  # a batch result carries no logprobs
        raise ApiError(400, "logprobs are not available in a batch line", param="logprobs")
    return GenerateRequest(
        req_id=uuid.uuid4().hex,
        model=req.model,
        sampling=req.sampling(),
        reply_subject=reply_subject,
        req_class="offline",
        prompt=req.prompt_text() if isinstance(req, CompletionRequest) else None,
        messages=req.chat_messages() if isinstance(req, ChatCompletionRequest) else None,
        arrival_unix_s=time.time(),
        class_name=lane.name if lane is not None else "offline",
        priority=lane.priority if lane is not None else 0,
    )


def error_body(exc: ApiError) -> dict[str, Any]:
    return {
        "error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    }


async def collect(
    handle: RequestHandle, on_tokens: Callable[[int], None] | None = None
) -> list[TokenChunk]:
    """Every chunk of `handle`'s stream; `on_tokens(n)` as each chunk of n tokens arrives."""
    chunks = []
    async for chunk in handle:
        chunks.append(chunk)
        if on_tokens is not None and chunk.num_tokens:
            on_tokens(chunk.num_tokens)
    return chunks


def response_body(endpoint: str, handle: RequestHandle, chunks: list[TokenChunk]) -> dict:
    """The JSON a non-streaming request to `endpoint` gets, from its chunks."""
    req = handle.request
    chat = endpoint == "/v1/chat/completions"
    last = chunks[-1]
    text = "".join(c.text for c in chunks)
    num_output = sum(c.num_tokens for c in chunks)
    prompt = handle.ack.num_prompt_tokens
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": last.finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + handle.client_req_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(req.arrival_unix_s),
        "model": req.model,
        "system_fingerprint": "tidal-sim-emulated"
        if handle.ack.is_emulated
        else f"tidal-{handle.ack.engine}",
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": num_output,
            "total_tokens": prompt + num_output,
        },
        "tidal": {
            "request_class": req.class_name or "offline",
            "instance": handle.instance_id,
            "engine": handle.ack.engine,
            "emulated": handle.ack.is_emulated,
        },
    }


async def run_line(
    bus: RequestBus,
    endpoint: str,
    body: dict[str, Any],
    handles: dict[str, RequestHandle],
    key: str,
    on_tokens: Callable[[int], None] | None = None,
    lane: RequestClassSpec | None = None,
) -> Outcome:
    """Run one line to its end. `handles[key]` holds the live request while it runs (so that a
    cancel can abort it)."""
    try:
        gen = build_request(endpoint, body, bus.reply_subject, lane)
    except ApiError as exc:
        return Outcome(exc.status, error_body(exc), "")
    try:
        handle = await bus.submit(gen)
    except ApiError as exc:
        return Outcome(exc.status, error_body(exc), gen.req_id, exc.status in RETRY_STATUSES)
    handles[key] = handle
    try:
        chunks = await collect(handle, on_tokens)
    except asyncio.CancelledError:  # the batch was cancelled or the service is stopping
        with contextlib.suppress(Exception):
            await asyncio.shield(handle.cancel("batch line cancelled"))
        raise
    finally:
        handles.pop(key, None)
        bus.release(handle)
    if not chunks or chunks[-1].finish_reason in _FAILED:
        reason = chunks[-1].error if chunks else "no output"
        failed = ApiError(502, f"generation failed: {reason}", type_="server_error")
        # NOTE: a failed generation (an instance error, an abort) is retried like a crash.
        return Outcome(502, error_body(failed), gen.req_id, retry=True)
    body_out = response_body(endpoint, handle, chunks)
    return Outcome(200, body_out, gen.req_id, output_tokens=body_out["usage"]["completion_tokens"])
