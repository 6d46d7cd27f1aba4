"""The instance's client of its CPU-attention workers (`tidal.engine.torch.piggyback.CpuAttnLink`):
one TCP connection per worker (wire format `tidal.cpu_attn.wire`), a reader thread per
connection filing attention outputs by (request, layer) for the engine thread to take, and the
choice of worker for an offload by free memory and load (OmniServe §4: a worker on another host
is just another address).

A connection that breaks loses only that worker's copies: its requests are reported by
`take_lost()` and the engine recomputes them from prompt + tokens so far.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
from dataclasses import dataclass, field

import torch

from tidal.cpu_attn import wire
from tidal.engine.api import OffloadRefused

log = logging.getLogger("tidal.instance")

CALL_TIMEOUT_S = 30.0  # an offload of a long context moves tens of MB


@dataclass
class _Reply:
    done: threading.Event = field(default_factory=threading.Event)
    msg: wire.Message | None = None
    payload: bytearray = field(default_factory=bytearray)


class WorkerConn:
    """One worker: blocking sends under a lock, replies and outputs from a reader thread."""

    def __init__(self, worker_id: str, host: str, port: int, pool: CpuAttnPool) -> None:
        self.id, self.addr = worker_id, f"{host}:{port}"
        self.pool = pool
        self.sock = socket.create_connection((host, port), timeout=5.0)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.alive = True
        self.free_bytes = 0
        self.num_reqs = 0
        self._send_lock = threading.Lock()
        self._calls: dict[int, _Reply] = {}
        self._ids = itertools.count(1)
        self._reader = threading.Thread(
            target=self._read, name=f"cpu-attn-{worker_id}", daemon=True
        )
        self._reader.start()
        try:
            self.call(wire.Hello)  # learn its free memory before choosing it for an offload
        except ConnectionError:
            self.close()
            raise

    def send(self, msg: wire.Message, payload: bytes | memoryview = b"") -> None:
        with self._send_lock:
            try:
                for buf in wire.frame(msg, payload):
                    self.sock.sendall(buf)
            except OSError as exc:
                self._lost(f"send failed: {exc}")
                raise ConnectionError(f"CPU-attention worker {self.id} is gone") from exc

    def call(self, make: type, payload: bytes | memoryview = b"", **kw: object) -> _Reply:
        call = next(self._ids)
        reply = self._calls[call] = _Reply()
        try:
            self.send(make(call=call, **kw), payload)
            if not reply.done.wait(CALL_TIMEOUT_S) or reply.msg is None:
                raise ConnectionError(f"CPU-attention worker {self.id} did not answer")
            return reply
        finally:
            self._calls.pop(call, None)

    def _read(self) -> None:
        why = "closed by the worker"
        try:
            while True:
                hn, pn = wire.parse_head(bytes(self._exact(wire.HEAD.size)))
                msg = wire.decode(bytes(self._exact(hn)))
                payload = self._exact(pn) if pn else bytearray()
                if isinstance(msg, wire.AttnOut):
                    self.pool._file(self, msg, payload)
                elif isinstance(msg, (wire.Ok, wire.Refused)):
                    self.free_bytes = msg.free_bytes
                    reply = self._calls.get(msg.call)
                    if reply is not None:
                        reply.msg, reply.payload = msg, payload
                        reply.done.set()
                else:
                    raise ValueError(f"unexpected {type(msg).__name__} frame from a worker")
        except (OSError, ConnectionError, ValueError) as exc:
            why = str(exc) or type(exc).__name__
        self._lost(why)

    def _exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("closed by the worker")
            got += k
        return buf

    def _lost(self, why: str) -> None:
        if not self.alive:
            return
        self.alive = False
        log.warning("CPU-attention worker %s (%s) lost: %s", self.id, self.addr, why)
        for reply in list(self._calls.values()):
            reply.done.set()
        self.pool._worker_lost(self)

    def close(self) -> None:
        self.alive = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class CpuAttnPool:
    """Every worker this instance uses; implements `tidal.engine.torch.piggyback.CpuAttnLink`."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerConn] = {}
        self.where: dict[str, str] = {}  # req_id -> worker id
        self._results: dict[tuple[str, int], torch.Tensor] = {}
        self._lost: set[str] = set()
        self._cond = threading.Condition()

    # ---- membership ----

    def connect(self, worker_id: str, host: str, port: int) -> None:
        """Use a worker (blocking connect; OSError if it cannot be reached)."""
        old = self.workers.get(worker_id)
        if old is not None and old.alive and old.addr == f"{host}:{port}":
            return
        if old is not None:
            old.close()
            self._worker_lost(old)
        self.workers[worker_id] = WorkerConn(worker_id, host, port, self)
        log.info("using CPU-attention worker %s at %s:%d", worker_id, host, port)

    def remove(self, worker_id: str) -> None:
        conn = self.workers.pop(worker_id, None)
        if conn is not None:
            conn.close()
            self._worker_lost(conn)

    def live(self) -> list[WorkerConn]:
        return [w for w in self.workers.values() if w.alive]

    def close(self) -> None:
        for w in list(self.workers.values()):
            w.close()

    # ---- CpuAttnLink ----

    def offload(self, req_id: str, kv: torch.Tensor, reserve_tokens: int) -> str:
        data = wire.to_bytes(kv)
        reasons = []
        # most free memory first, then fewest requests (§4: spread by memory and load)
        for w in sorted(self.live(), key=lambda w: (-w.free_bytes, w.num_reqs)):
            try:
                reply = w.call(
                    wire.Offload,
                    data,
                    req_id=req_id,
                    shape=list(kv.shape),
                    dtype=wire.dtype_name(kv.dtype),
                    reserve_tokens=reserve_tokens,
                    crc32=wire.crc32(data),
                )
            except ConnectionError as exc:
                reasons.append(f"{w.id}: {exc}")
                continue
            if isinstance(reply.msg, wire.Ok):
                with self._cond:
                    self.where[req_id] = w.id
                    w.num_reqs += 1
                return w.id
            assert isinstance(reply.msg, wire.Refused)
            reasons.append(f"{w.id}: {reply.msg.reason}")
        raise OffloadRefused("; ".join(reasons) or "no CPU-attention worker is connected")

    def recall(self, req_id: str) -> torch.Tensor:
        w = self._conn_of(req_id)
        reply = w.call(wire.Recall, req_id=req_id)
        msg = reply.msg
        if not isinstance(msg, wire.Ok):
            raise KeyError(f"{req_id}: {getattr(msg, 'reason', 'no answer')}")
        if wire.crc32(reply.payload) != msg.crc32:
            raise ValueError(f"{req_id}: recalled KV fails its checksum")
        return wire.from_bytes(reply.payload, msg.dtype, msg.shape)

    def drop(self, req_id: str) -> None:
        with self._cond:
            wid = self.where.pop(req_id, None)
            for key in [k for k in self._results if k[0] == req_id]:
                del self._results[key]
            self._lost.discard(req_id)
        w = self.workers.get(wid or "")
        if w is None or not w.alive:
            return
        w.num_reqs -= 1
        with contextlib.suppress(ConnectionError):
            w.send(wire.Drop(req_id))

    def send(
        self,
        layer: int,
        rows: list[tuple[str, int]],
        qkv: torch.Tensor,
        num_heads: int,
        scale: float,
    ) -> None:
        by_worker: dict[str, list[int]] = {}
        for i, (rid, _) in enumerate(rows):
            wid = self.where.get(rid)
            if wid is None:
                with self._cond:
                    self._lost.add(rid)
                continue
            by_worker.setdefault(wid, []).append(i)
        _, heads2, D = qkv.shape
        Hk = (heads2 - num_heads) // 2
        for wid, idx in by_worker.items():
            w = self.workers.get(wid)
            part = qkv if len(idx) == len(rows) else qkv[idx]
            msg = wire.Attn(
                layer,
                [rows[i][0] for i in idx],
                [rows[i][1] for i in idx],
                [num_heads, Hk, D],
                wire.dtype_name(qkv.dtype),
                scale,
            )
            try:
                if w is None:
                    raise ConnectionError(wid)
                w.send(msg, wire.to_bytes(part))
            except ConnectionError:
                with self._cond:
                    self._lost.update(rows[i][0] for i in idx)

    def take(self, layer: int, req_ids: list[str]) -> dict[str, torch.Tensor]:
        with self._cond:
            return {
                rid: self._results.pop((rid, layer))
                for rid in req_ids
                if (rid, layer) in self._results
            }

    def wait(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait(timeout_s)

    def take_lost(self) -> set[str]:
        with self._cond:
            lost, self._lost = self._lost, set()
            for rid in lost:
                self.where.pop(rid, None)
            return lost

    def capacity(self) -> tuple[int, int]:
        live = self.live()
        return len(live), sum(w.free_bytes for w in live)

    # ---- from reader threads ----

    def _file(self, w: WorkerConn, msg: wire.AttnOut, payload: bytearray) -> None:
        n = len(msg.req_ids)
        out = wire.from_bytes(payload, msg.dtype, [n, msg.width]) if n else None
        with self._cond:
            for i, rid in enumerate(msg.req_ids):
                if rid in msg.errors:
                    why = msg.errors[rid]
                    log.warning("worker %s failed %s at layer %d: %s", w.id, rid, msg.layer, why)
                    self._lost.add(rid)
                elif out is not None and rid in self.where:  # not dropped or recalled since
                    self._results[(rid, msg.layer)] = out[i]
            self._cond.notify_all()

    def _worker_lost(self, w: WorkerConn) -> None:
        with self._cond:
            for rid, wid in list(self.where.items()):
                if wid == w.id:
                    self._lost.add(rid)
            self._cond.notify_all()

    def _conn_of(self, req_id: str) -> WorkerConn:
        w = self.workers.get(self.where.get(req_id, ""))
        if w is None or not w.alive:
            raise KeyError(f"{req_id} is not held by a live worker")
        return w
