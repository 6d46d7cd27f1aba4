"""Joining the NATS bus: bounded start-up, reconnect forever after, safe message handlers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tidal.schemas import codec

log = logging.getLogger(__name__)
T = TypeVar("T")


def redact(url: object) -> str:
    """A NATS URL (or comma-separated list of them) fit for a log line: tokens and
    user:password dropped."""
    text = url.geturl() if hasattr(url, "geturl") else str(url)
    out = []
    for part in text.split(","):
        scheme, sep, rest = part.strip().rpartition("://")
        out.append(f"{scheme}{sep}{rest.split('@')[-1]}")
    return ",".join(out)


def seed_urls(url: str) -> tuple[list[str], dict[str, str]]:
    """The servers of `nats://a:4222,nats://b:4222` (seeds: the client learns the rest of the
    cluster from any one) and the credentials the first URL carries, as connect options, so
    that the servers the cluster announces (which come without credentials) accept us too."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError("the NATS URL names no server")
    auth: dict[str, str] = {}
    for server in servers:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        if parts.username is None:
            continue
        if parts.password is None:
            auth = {"token": unquote(parts.username)}
        else:
            auth = {"user": unquote(parts.username), "password": unquote(parts.password)}
        break
    return servers, auth


class BusUnavailable(RuntimeError):
    """NATS could not be reached within the start-up timeout."""


async def connect(url: str, name: str, timeout_s: float = 10.0) -> NATS:
    """Connect within `timeout_s` or raise `BusUnavailable` with a one-line reason.

    `url` may list several servers, comma-separated (the nodes of a NATS cluster). Once
    connected, the client reconnects without limit, to any node of the cluster: a restarted
    nats-server, or another node, is rejoined.
    """
    servers, auth = seed_urls(url)

    async def _quiet_error(exc: Exception) -> None:
        log.warning("nats: %s", exc)

    async def _disconnected() -> None:
        log.warning("nats: disconnected from %s, reconnecting", redact(url))

    async def _reconnected() -> None:
        log.info("nats: reconnected to %s", redact(url))

    try:
        return await asyncio.wait_for(
            nats.connect(
                servers,
                name=name,
                **auth,  # type: ignore[arg-type]
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=_quiet_error,
                disconnected_cb=_disconnected,
                reconnected_cb=_reconnected,
            ),
            timeout=timeout_s,
        )
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        raise BusUnavailable(
            f"cannot reach NATS at {redact(url)} within {timeout_s:.0f}s ({type(exc).__name__})"
        ) from None


Handler = Callable[[T, Msg], Awaitable[None]]


async def subscribe(
    nc: NATS,
    subject: str,
    type_: type[T],
    handler: Handler[T],
    *,
    queue: str = "",
    json: bool = False,
) -> Subscription:
    """Subscribe with a typed handler. A malformed message is logged with its subject and dropped;
    an exception in the handler is logged and never reaches the connection."""

    async def _cb(msg: Msg) -> None:
        try:
            decoded = codec.decode_json(msg.data, type_) if json else codec.decode(msg.data, type_)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            log.warning("dropped malformed message on %s: %s", msg.subject, exc)
            if json and msg.reply:
                await msg.respond(codec.encode_json({"error": f"malformed request: {exc}"}))
            return
        try:
            await handler(decoded, msg)
        except Exception:
            log.exception("handler for %s failed; message dropped", msg.subject)

    return await nc.subscribe(subject, queue=queue, cb=_cb)


async def respond(msg: Msg, reply: Any, *, json: bool = False) -> None:
    if msg.reply:
        await msg.respond(codec.encode_json(reply) if json else codec.encode(reply))
