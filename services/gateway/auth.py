"""API keys and request size limits, as an ASGI middleware in front of every route.

Keys come from `--api-key` (repeatable) and `TIDAL_API_KEYS` (comma-separated); with none the
gateway is open, as before. A request to `/v1/*` must carry `Authorization: Bearer <key>`,
compared in constant time with every configured key; otherwise 401 in OpenAI's error body.
`/health` and `/ready` are always open, `/metrics` unless `--metrics-need-key`. The key's owner
id (a hash, never the key) is put on the request scope: files and batches are visible only to the
key that made them (another key's id answers 404, so their existence is not disclosed).

Bodies over the limit answer 413 before they are read: by `Content-Length`, and for a chunked
body by counting as it streams in. With `--rate-limit`, each key's `/v1/*` requests go through
its token bucket (`services/gateway/ratelimit.py`); past it, 429 with `Retry-After`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import Iterable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.ratelimit import RateLimiter, retry_after_header
from tidal.config.classes import ClassTable

API_KEYS_ENV = "TIDAL_API_KEYS"
MAX_JSON_BODY_BYTES = 16 * 1024 * 1024  # a chat request with a long context fits easily
MAX_UPLOAD_BYTES = 200 * 1024 * 1024 + 64 * 1024  # OpenAI's batch file limit, plus form framing
_OPEN_PATHS = ("/health", "/ready")
_OWNER_ID = re.compile(r"^key-[0-9a-f]{16}$")


def keys_from(flags: Iterable[str], env: str | None = None) -> list[str]:
    """Configured keys: the flags, then the environment's; blanks dropped, order kept."""
    raw = list(flags) + (env if env is not None else os.environ.get(API_KEYS_ENV, "")).split(",")
    out: list[str] = []
    for k in (k.strip() for k in raw):
        if k and k not in out:
            out.append(k)
    return out


def owner_of(key: str) -> str:
    """A stable id for what a key owns; the key itself is never stored."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def keyed_by_owner(table: ClassTable) -> ClassTable:
    """`table` with its `class_keys` keyed by owner id (`owner_of`), as requests carry it; a
    config may give the key itself or its owner id (`key-...`, which holds no secret)."""
    keys = {k if _OWNER_ID.match(k) else owner_of(k): rule for k, rule in table.keys.items()}
    return dataclasses.replace(table, keys=keys)


def _error(status: int, message: str, type_: str, code: str) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return status, json.dumps(body).encode()


class Guard:
    """ASGI middleware: API keys (401), per-key rate limits (429) and body size limits (413)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: list[str],
        metrics_need_key: bool = False,
        rate_limiter: RateLimiter | None = None,
    ) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.metrics_need_key = metrics_need_key
        self.rate_limiter = rate_limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        owner = ""
        if self.keys and self._needs_key(path):
            token = _bearer(headers.get("authorization", b""))
            match = b""
            for k in self.keys:  # every key compared: the time says nothing about which
                if hmac.compare_digest(token, k):
                    match = k
            if not match:
                error = _error(401, _no_key_message(token), "invalid_request_error",
                               "invalid_api_key")  # fmt: skip
                await _answer(send, *error)
                return
            owner = owner_of(match.decode())
        scope.setdefault("state", {})["owner"] = owner
        if self.rate_limiter is not None and path.startswith("/v1/"):
            client = scope.get("client") or ("", 0)
            wait_s = self.rate_limiter.check(owner or f"addr:{client[0]}", time.monotonic())
            if wait_s > 0:
                await _answer(send, *_rate_limited(self.rate_limiter, wait_s),
                              retry_after=retry_after_header(wait_s))  # fmt: skip
                return
        limit = MAX_UPLOAD_BYTES if path.rstrip("/") == "/v1/files" else MAX_JSON_BODY_BYTES
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _answer(send, *_too_large(limit))
            return
        started = False

        async def tracked(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, _counting(receive, limit), tracked)
        except _BodyTooLarge:
            if not started:
                await _answer(send, *_too_large(limit))

    def _needs_key(self, path: str) -> bool:
        if path in _OPEN_PATHS:
            return False
        if path == "/metrics":
            return self.metrics_need_key
        return True


def _bearer(value: bytes) -> bytes:
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def _no_key_message(token: bytes) -> str:
    if not token:
        return "You didn't provide an API key (Authorization: Bearer <key>)."
    return "Incorrect API key provided."


def _too_large(limit: int) -> tuple[int, bytes]:
    return _error(413, f"the request body is over {limit} bytes", "invalid_request_error",
                  "request_too_large")  # fmt: skip


def _rate_limited(limiter: RateLimiter, wait_s: float) -> tuple[int, bytes]:
    message = (f"Rate limit reached for this API key: {limiter.rate:g} requests/s, bursts of "
               f"{limiter.burst:g}. Please try again in {wait_s:.3f}s.")  # fmt: skip
    return _error(429, message, "requests", "rate_limit_exceeded")


class _BodyTooLarge(StarletteHTTPException):
    """Raised while a body streams in past its limit. An HTTPException, so the framework's body
    parsing lets it through (it turns other errors into 400) and it answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over {limit} bytes")
        self.limit = limit


def _counting(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        msg = await receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge(limit)
        return msg

    return wrapped


async def _answer(send: Send, status: int, body: bytes, retry_after: str = "") -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if retry_after:
        headers.append((b"retry-after", retry_after.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
