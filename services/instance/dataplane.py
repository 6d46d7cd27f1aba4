"""The KV data plane: a request's KV moves instance to instance over a direct TCP connection,
never over NATS (the control plane), streamed in bounded chunks from the source's KV blocks into
the target's reserved blocks (`tidal.engine.migrate`), framed and checksummed per chunk
(`tidal.schemas.kv_wire`).

Everything here runs on threads with blocking sockets, never on the asyncio loop: a gigabyte of
KV is copied, checksummed and written without the loop noticing (heartbeats, offers and tokens
keep flowing). The receiver holds one frame buffer per transfer, so its memory is bounded by
``max_transfers * MAX_FRAME_BYTES`` whatever the request's size; beyond ``max_transfers`` it
refuses at once (the source keeps the request and may try again). Every socket has a timeout: a
transfer whose peer stalls fails alone, and the handshake (`services/instance/migration.py`)
leaves the request where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from typing import Protocol

from services.common.torch_threads import SingleTorchThreadExecutor, single_torch_thread
from tidal.engine.migrate import KvSink, KvSource, MovableEngine, chunk_ranges
from tidal.schemas import kv_wire as wire

log = logging.getLogger("tidal.dataplane")

IO_TIMEOUT_S = 10.0  # a peer silent this long fails its transfer
CONNECT_TIMEOUT_S = 3.0  # a target whose packets are dropped fails fast (and is backed off)
MAX_STATE_BYTES = 256 << 20  # tokens, sampling, any partial chunk's hidden state
SEND_SLOTS = 4  # transfers one source streams at once; more wait their turn


class TransferError(RuntimeError):
    """The KV did not arrive, or the receiver refused it (the reason is the message)."""


class TransferRefused(Exception):
    """Raised by a `Receiver` that will not take this transfer; the text goes to the sender."""


class Receiver(Protocol):
    """Where the data plane's transfers land. Both calls come on data-plane threads."""

    def open_transfer(self, hello: wire.Hello, state: bytes) -> KvSink:
        """The sink for the transfer's KV (its blocks reserved); raise `TransferRefused`."""
        ...

    def end_transfer(self, ticket: str, error: str) -> None:
        """The transfer ended: all KV written (error ""), or not (why)."""
        ...


def parse_url(url: str) -> tuple[str, int]:
    """'tcp://host:port' -> (host, port); ValueError with the URL otherwise."""
    rest = url.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if not url.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(f"data plane URL {url!r} is not tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


class DataPlaneServer:
    """Accepts transfers for tickets this instance handed out in its migration offers."""

    def __init__(
        self, receiver: Receiver, max_transfers: int = 8, io_timeout_s: float = IO_TIMEOUT_S
    ) -> None:
        self.receiver = receiver
        self.max_transfers = max_transfers
        self.io_timeout_s = io_timeout_s
        self.url = ""
        self.num_bytes_received = 0
        self.num_transfers = {"ok": 0, "failed": 0, "refused": 0}
        self._slots = threading.BoundedSemaphore(max_transfers)
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None
    ) -> str:
        """Listen on host:port; the URL other instances reach it at names `advertise_host`
        (the bound address when not given)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=64)
        sock.settimeout(0.5)  # the accept loop notices `close`
        self._sock = sock
        bound_port = sock.getsockname()[1]
        shown = advertise_host or host
        self.url = (
            f"tcp://[{shown}]:{bound_port}" if ":" in shown else f"tcp://{shown}:{bound_port}"
        )
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()
        return self.url

    async def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.io_timeout_s)
        with conn:
            if not self._slots.acquire(blocking=False):
                self._count("refused")
                self._answer(conn, f"busy: {self.max_transfers} transfers in flight here")
                return
            try:
                single_torch_thread()  # it writes KV into torch blocks: no OpenMP pool here
                reason = self._receive(conn)
            finally:
                self._slots.release()
            self._answer(conn, reason)

    def _count(self, outcome: str, num_bytes: int = 0) -> None:
        with self._lock:
            self.num_transfers[outcome] += 1
            self.num_bytes_received += num_bytes

    @staticmethod
    def _answer(conn: socket.socket, reason: str) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(b"ok\n" if not reason else f"error {reason}\n".encode())

    def _receive(self, conn: socket.socket) -> str:
        """Read one transfer; "" when every byte landed in the sink, else why not."""
        headbuf = memoryview(bytearray(wire.HEAD.size))
        buf = memoryview(bytearray(wire.MAX_FRAME_BYTES))  # the only buffer a transfer holds
        ticket, moved = "", 0
        try:
            _recv_exactly(conn, headbuf)
            kind, length, _, crc = wire.parse_head(headbuf)
            if kind != wire.HELLO:
                raise wire.WireError("a transfer starts with its hello")
            _recv_exactly(conn, buf[:length])
            wire.check(buf[:length], crc)
            hello = wire.decode_hello(buf[:length])
            ticket = hello.ticket
            if hello.state_bytes > MAX_STATE_BYTES:
                raise wire.WireError(f"state of {hello.state_bytes} bytes is over the limit")
            state = bytearray()
            while len(state) < hello.state_bytes:
                _recv_exactly(conn, headbuf)
                kind, length, offset, crc = wire.parse_head(headbuf)
                if kind != wire.STATE or offset != len(state):
                    raise wire.WireError("state frames out of order")
                _recv_exactly(conn, buf[:length])
                wire.check(buf[:length], crc)
                state += buf[:length]
            try:
                sink = self.receiver.open_transfer(hello, bytes(state))
            except TransferRefused as exc:
                self._count("refused")
                return f"refused: {exc}"
        except (wire.WireError, OSError) as exc:
            self._count("failed")
            return f"transfer broken before its KV: {exc}"
        try:
            moved = self._receive_kv(conn, headbuf, buf, sink)
        except (wire.WireError, OSError, ValueError) as exc:
            error = f"transfer broken: {exc}"
        except Exception as exc:  # never let a peer's bytes kill the server
            log.exception("data plane: unexpected error receiving %s", ticket)
            error = f"receiver error: {exc}"
        else:
            error = ""
        with contextlib.suppress(Exception):
            self.receiver.end_transfer(ticket, error)
        self._count("failed" if error else "ok", moved)
        return error

    def _receive_kv(
        self, conn: socket.socket, headbuf: memoryview, buf: memoryview, sink: KvSink
    ) -> int:
        moved = 0
        while True:
            _recv_exactly(conn, headbuf)
            kind, length, offset, crc = wire.parse_head(headbuf)
            if kind == wire.END:
                break
            if kind != wire.KV:
                raise wire.WireError(f"unexpected frame kind {kind} among KV frames")
            _recv_exactly(conn, buf[:length])
            wire.check(buf[:length], crc)
            sink.write(offset, buf[:length])  # straight into the reserved blocks
            moved += length
        expected = sink.num_tokens * sink.bytes_per_token
        if moved != expected:
            raise wire.WireError(f"{moved} of {expected} KV bytes arrived")
        return moved


# one torch thread each: reading KV out of torch blocks must not open an OpenMP pool here
_senders = SingleTorchThreadExecutor(max_workers=SEND_SLOTS, thread_name_prefix="kv-send")


def send_kv_blocking(
    url: str,
    ticket: str,
    source: KvSource,
    chunk_bytes: int = wire.CHUNK_BYTES,
    io_timeout_s: float = IO_TIMEOUT_S,
) -> float:
    """Stream `source` to the receiver at `url` for `ticket`; the seconds it took. Raises
    `TransferError`. Blocking: call it from a thread (`send_kv`)."""
    t0 = time.perf_counter()
    try:
        host, port = parse_url(url)
        sock = socket.create_connection((host, port), timeout=min(CONNECT_TIMEOUT_S, io_timeout_s))
    except (OSError, ValueError) as exc:
        raise TransferError(f"cannot reach {url}: {exc}") from None
    sock.settimeout(io_timeout_s)
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = wire.encode_hello(
                wire.Hello(ticket, len(source.state), source.num_tokens, source.bytes_per_token)
            )
            sock.sendall(wire.head(wire.HELLO, hello) + hello)
            state = memoryview(source.state)
            for off in range(0, len(state), chunk_bytes):
                piece = state[off : off + chunk_bytes]
                sock.sendall(wire.head(wire.STATE, piece, off))
                sock.sendall(piece)
            for r in chunk_ranges(source.num_tokens, source.bytes_per_token, chunk_bytes):
                data = source.read(r.start, r.stop)  # copied out of the source's blocks
                sock.sendall(wire.head(wire.KV, data, r.start))
                sock.sendall(data)
            sock.sendall(wire.head(wire.END, b""))
        except OSError as exc:
            answer = _read_answer(sock)  # a receiver that refused says why, then closes
            raise TransferError(answer or f"transfer to {url} broke: {exc}") from None
        answer = _read_answer(sock)
    if answer != "ok":
        raise TransferError(answer or "receiver closed the connection without an answer")
    return time.perf_counter() - t0


def _read_answer(sock: socket.socket) -> str:
    line = b""
    with contextlib.suppress(OSError):
        while not line.endswith(b"\n") and len(line) < 4096:
            piece = sock.recv(4096)
            if not piece:
                break
            line += piece
    return line.decode(errors="replace").strip().removeprefix("error ")


async def send_kv(
    url: str, ticket: str, source: KvSource, chunk_bytes: int = wire.CHUNK_BYTES
) -> float:
    """`send_kv_blocking` on one of `SEND_SLOTS` sender threads (more transfers wait their turn)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_senders, send_kv_blocking, url, ticket, source, chunk_bytes)


class EngineReceiver:
    """A `Receiver` straight into one engine that nothing else steps meanwhile (benches, tests):
    every transfer is imported, and committed when its KV is complete."""

    def __init__(self, engine: MovableEngine) -> None:
        self.engine = engine
        self.sinks: dict[str, KvSink] = {}
        self.errors: dict[str, str] = {}  # ticket -> why its transfer failed
        self.committed: list[str] = []  # req_ids

    def open_transfer(self, hello: wire.Hello, state: bytes) -> KvSink:
        try:
            sink = self.engine.begin_import(state)
        except (ValueError, MemoryError) as exc:
            raise TransferRefused(str(exc)) from None
        self.sinks[hello.ticket] = sink
        return sink

    def end_transfer(self, ticket: str, error: str) -> None:
        sink = self.sinks.pop(ticket)
        if error:
            self.errors[ticket] = error
            self.engine.end_import(sink.req_id, commit=False)
        else:
            self.engine.end_import(sink.req_id, commit=True)
            self.committed.append(sink.req_id)
