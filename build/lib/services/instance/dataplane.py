"""The KV data plane: request payloads (KV of all layers) move instance to instance over a direct
TCP connection, never over NATS (which caps messages at 1 MB and is the control plane).

One connection per transfer. The sender writes one JSON header line
``{"ticket", "num_bytes", "checksum"}`` and then the payload in chunks; the receiver checks the
size and the blake2b checksum the migration offer announced, hands the bytes to its callback, and
answers one line: ``ok`` or ``error <reason>``. asyncio streams only: no extra dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("tidal.dataplane")

CHUNK_BYTES = 1 << 20  # write size: bounded memory per write, and progress for the reader
MAX_HEADER_BYTES = 4096
IO_TIMEOUT_S = 30.0  # a stalled peer fails the transfer instead of hanging it

# (ticket, payload) -> "" when accepted, else the reason it was refused
PayloadHandler = Callable[[str, bytes], Awaitable[str]]


class TransferError(RuntimeError):
    """The payload did not arrive, or the receiver refused it (the reason is the message)."""


def checksum(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def parse_url(url: str) -> tuple[str, int]:
    """'tcp://host:port' -> (host, port); ValueError with the URL otherwise."""
    rest = url.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if not url.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(f"data plane URL {url!r} is not tcp://HOST:PORT")
    return host, int(port)


class DataPlaneServer:
    """Receives payloads for tickets this instance handed out in its migration offers."""

    def __init__(self, handler: PayloadHandler, max_bytes: int) -> None:
        self.handler = handler
        self.max_bytes = max_bytes  # a header announcing more is refused before any byte is read
        self.server: asyncio.Server | None = None
        self.url = ""
        self.num_bytes_received = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.server = await asyncio.start_server(self._serve, host, port)
        sock = self.server.sockets[0].getsockname()
        self.url = f"tcp://{sock[0]}:{sock[1]}"
        return self.url

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reason = await asyncio.wait_for(self._receive(reader), IO_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = f"transfer broken: {type(exc).__name__}"
        except Exception as exc:  # never let a peer's bytes kill the server
            log.exception("data plane: unexpected error")
            reason = f"receiver error: {exc}"
        with contextlib.suppress(ConnectionError):
            writer.write(b"ok\n" if not reason else f"error {reason}\n".encode())
            await writer.drain()
            writer.close()

    async def _receive(self, reader: asyncio.StreamReader) -> str:
        line = await reader.readline()
        if len(line) > MAX_HEADER_BYTES or not line.endswith(b"\n"):
            return "malformed header"
        try:
            head = json.loads(line)
            ticket, num_bytes, digest = (
                str(head["ticket"]),
                int(head["num_bytes"]),
                head["checksum"],
            )
        except (ValueError, KeyError, TypeError):
            return "malformed header"
        if not 0 <= num_bytes <= self.max_bytes:
            return f"payload of {num_bytes} bytes is over this receiver's {self.max_bytes}"
        data = await reader.readexactly(num_bytes)
        if checksum(data) != digest:
            return "checksum mismatch"
        self.num_bytes_received += num_bytes
        return await self.handler(ticket, data)


async def send_payload(url: str, ticket: str, data: bytes, digest: str) -> float:
    """Send `data` for `ticket`; returns the seconds it took. Raises `TransferError`."""
    t0 = time.perf_counter()
    try:
        host, port = parse_url(url)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), IO_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError) as exc:
        raise TransferError(f"cannot reach {url}: {exc}") from None
    try:
        head = {"ticket": ticket, "num_bytes": len(data), "checksum": digest}
        writer.write(json.dumps(head).encode() + b"\n")
        view = memoryview(data)
        for off in range(0, len(data), CHUNK_BYTES):
            writer.write(view[off : off + CHUNK_BYTES])
            await asyncio.wait_for(writer.drain(), IO_TIMEOUT_S)
        answer = await asyncio.wait_for(reader.readline(), IO_TIMEOUT_S)
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise TransferError(f"transfer to {url} broke: {type(exc).__name__}") from None
    finally:
        writer.close()
    text = answer.decode(errors="replace").strip()
    if text != "ok":
        raise TransferError(text.removeprefix("error ") or "receiver closed the connection")
    return time.perf_counter() - t0
