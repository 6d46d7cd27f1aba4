"""Addresses a service binds and advertises, so that other hosts can reach it.

A service bound to `0.0.0.0` (every interface) must not tell its peers `127.0.0.1`: on another
host that is the peer itself. The address it advertises is, in order:

1. `--advertise-host` / `$TIDAL_ADVERTISE_HOST` when given;
2. the bind address, when it is a specific one;
3. the address of the interface that routes to the NATS server (a UDP `connect`, which sends
   nothing, makes the kernel pick the source address of that route) — the interface the bus
   reaches this host on is the one its peers reach it on too;
4. when the bus is on loopback too (one machine bound to every interface): the interface of the
   default route, then any non-loopback address of the host name; `127.0.0.1` only when the host
   has no other address at all.

The bind address defaults to loopback when the bus is on loopback (one machine: nothing is
exposed) and to every interface otherwise (the bus is on another host, so peers are too).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

WILDCARD_HOSTS = frozenset(("", "0.0.0.0", "::", "[::]", "*"))
LOOPBACK = "127.0.0.1"
# TEST-NET-1 (RFC 5737): never answers, but a UDP connect to it picks the default route.
_DEFAULT_ROUTE_PROBE = ("192.0.2.1", 9)

# (host, port) -> the local source address of the route to it, or None when there is no route
RouteProbe = Callable[[str, int], "str | None"]


def bus_endpoints(nats_url: str) -> list[tuple[str, int]]:
    """The (host, port) of every server in a NATS URL list (`nats://a:4222,nats://b:4222`);
    credentials are dropped. ValueError names the part that is not a server URL."""
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in nats_url.split(",")):
        if not part:
            continue
        split = urlsplit(part if "://" in part else f"nats://{part}")
        try:
            host, port = split.hostname, split.port or 4222
        except ValueError:
            host = None
        if not host:
            raise ValueError(f"{part.split('@')[-1]!r} is not a NATS server URL")
        out.append((host, port))
    if not out:
        raise ValueError("the NATS URL names no server")
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def default_bind_host(nats_url: str) -> str:
    """Loopback when every bus server is on loopback (one machine), else every interface."""
    try:
        endpoints = bus_endpoints(nats_url)
    except ValueError:
        return LOOPBACK
    return LOOPBACK if all(is_loopback(h) for h, _ in endpoints) else "0.0.0.0"


def route_source(host: str, port: int) -> str | None:
    """The local address the kernel would send from to reach (host, port); None without a
    route. A UDP socket's `connect` sends no packet: it only picks the route."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            addr: str = s.getsockname()[0]
    except (OSError, IndexError):
        return None
    return addr if addr and addr != "0.0.0.0" else None


def _host_addresses() -> list[str]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return [str(i[4][0]) for i in infos]


def resolve_advertise_host(
    bind_host: str,
    explicit: str,
    nats_url: str,
    *,
    probe: RouteProbe = route_source,
    host_addresses: Callable[[], list[str]] = _host_addresses,
) -> str:
    """The address peers reach a service bound to `bind_host` on (see the module docstring)."""
    if explicit:
        return explicit
    if not is_wildcard(bind_host):
        return bind_host
    try:
        endpoints = bus_endpoints(nats_url)
    except ValueError:
        endpoints = []
    candidates = [probe(h, p) for h, p in endpoints]
    candidates.append(probe(*_DEFAULT_ROUTE_PROBE))
    candidates += host_addresses()
    for addr in candidates:
        if addr and not is_loopback(addr):
            return addr
    return LOOPBACK
