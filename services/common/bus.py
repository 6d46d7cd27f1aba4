"""Joining the NATS bus: bounded start-up, reconnect forever after, safe message handlers.

Across hosts (a NATS node on each, every service given the same seeds) a service joins the node
on its own host first, then the seeds in the order given (`order_seeds`, nats.py's
`dont_randomize`): a randomly chosen remote node ties the service's fate to another host's link,
so that one cut link silenced services on hosts that were never cut. A dead connection is noticed
within `PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1)` seconds (nats.py's default ping is every 2
minutes, which kept a stalled TCP connection "connected" through a cut), then the client moves to
another node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
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

JS_INFO_SUBJECT = "$JS.API.INFO"  # JetStream's account info: answered by the meta leader
JS_NOT_ENABLED = 10039  # JetStream's error code: "jetstream not enabled for account"
PING_INTERVAL_S = 2  # a ping this often; a connection that misses MAX_OUTSTANDING_PINGS is dead
MAX_OUTSTANDING_PINGS = 2


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


def is_local_host(host: str) -> bool:
    """Whether `host` (a name or an address) is one of this host's own addresses: a socket
    binds only to an address the host has, so a bind to port 0 answers without sending
    anything. A name that does not resolve is not local."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr[0], 0))
            return True
    return False


def order_seeds(servers: list[str]) -> list[str]:
    """`servers` with those on this host first, otherwise in the order given."""

    def host_of(server: str) -> str:
        return urlsplit(server if "://" in server else f"nats://{server}").hostname or ""

    local = [s for s in servers if is_local_host(host_of(s))]
    return local + [s for s in servers if s not in local]


class BusUnavailable(RuntimeError):
    """NATS could not be reached within the start-up timeout."""


async def connect(url: str, name: str, timeout_s: float = 10.0) -> NATS:
    """Connect within `timeout_s` or raise `BusUnavailable` with a one-line reason.

    `url` may list several servers, comma-separated (the nodes of a NATS cluster): the one on
    this host is tried first, then the others in order (see the module docstring). Once
    connected, the client reconnects without limit, to any node of the cluster: a restarted
    nats-server, or another node, is rejoined.
    """
    servers, auth = seed_urls(url)
    servers = order_seeds(servers) if len(servers) > 1 else servers

    async def _quiet_error(exc: Exception) -> None:
        log.warning("nats: %s", exc)

    async def _disconnected() -> None:
        log.warning("nats: disconnected from %s, reconnecting", redact(url))

    async def _reconnected() -> None:
        log.info("nats: reconnected to %s", redact(getattr(nc, "connected_url", None) or url))

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers,
                name=name,
                **auth,  # type: ignore[arg-type]
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                dont_randomize=True,
                ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
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
    log.info("nats: %s connected to %s", name, redact(nc.connected_url))
    return nc


async def jetstream_quorum(nc: NATS, timeout_s: float) -> bool | None:
    """Whether JetStream's cluster answers through this connection: True when it does, False
    when it does not (this node is in a minority partition or cut off from the others: the
    meta leader is out of reach), None when this bus has no JetStream at all."""
    try:
        msg = await nc.request(JS_INFO_SUBJECT, b"", timeout=timeout_s)
    except nats.errors.NoRespondersError:
        return None
    except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, OSError):
        return False
    try:
        error = json.loads(msg.data).get("error")
    except (ValueError, AttributeError):
        return False
    if not error:
        return True
    return None if error.get("err_code") == JS_NOT_ENABLED else False


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
