"""The CPU-attention worker's data plane: a TCP server over a `KvStore` (wire format in
`tidal.cpu_attn.wire`). Each connection is one instance; its frames are served in order, the
attention of each `Attn` frame in a worker thread so the connection keeps reading meanwhile.
A malformed frame closes that connection (its peer re-queues what it had here) and is logged;
the worker and its other connections go on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import torch

from services.common.torch_threads import ComputeThread
from tidal.cpu_attn import wire
from tidal.cpu_attn.kv_store import KvStore, StoreFull
from tidal.cpu_attn.layer_timer import LayerTimer

log = logging.getLogger("tidal.cpu_attn")


class AttnServer:
    def __init__(self, store: KvStore) -> None:
        self.store = store
        self.timer = LayerTimer()
        self.num_connections = 0
        self.num_rows = 0  # attention rows computed (one request at one layer each)
        self.num_ctx_tokens = 0  # context tokens those rows attended over
        self._server: asyncio.Server | None = None
        self.port = 0
        self._owned: dict[asyncio.StreamWriter, set[str]] = {}
        # attention and KV copies on one thread (`services.common.torch_threads`)
        self.compute = ComputeThread("cpu-attn")

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._owned):
                w.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        self.compute.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        owned: set[str] = set()
        self._owned[writer] = owned
        peer = writer.get_extra_info("peername")
        queue: asyncio.Queue[tuple[wire.Message, bytearray] | None] = asyncio.Queue()
        worker = asyncio.create_task(self._process(queue, writer, owned))
        try:
            while True:
                prefix = await reader.readexactly(wire.HEAD.size)
                hn, pn = wire.parse_head(prefix)
                msg = wire.decode(await reader.readexactly(hn))
                payload = bytearray(await reader.readexactly(pn)) if pn else bytearray()
                await queue.put((msg, payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the instance went away
        except ValueError as exc:
            log.warning("dropping connection from %s: %s", peer, exc)
        except asyncio.CancelledError:
            # The worker is stopping. Not raised on: Python 3.11's stream server logs a
            # cancelled connection handler as "Exception in callback" with a traceback.
            worker.cancel()
        finally:
            await queue.put(None)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await worker
            # An instance that is gone will never recall or drop what it offloaded here.
            for rid in owned:
                self.store.drop(rid)
            self._owned.pop(writer, None)
            self.num_connections -= 1
            writer.close()

    async def _process(
        self,
        queue: asyncio.Queue[tuple[wire.Message, bytearray] | None],
        writer: asyncio.StreamWriter,
        owned: set[str],
    ) -> None:
        while (item := await queue.get()) is not None:
            msg, payload = item
            try:
                reply = await self._handle(msg, payload, owned)
            except (ValueError, KeyError, RuntimeError) as exc:
                log.warning("bad %s frame: %s", type(msg).__name__, exc)
                call = getattr(msg, "call", -1)
                reply = [] if call < 0 else wire.frame(wire.Refused(call, f"bad request: {exc}"))
            if reply:
                writer.writelines(reply)
                try:
                    await writer.drain()
                except ConnectionError:
                    return

    async def _handle(
        self, msg: wire.Message, payload: bytearray, owned: set[str]
    ) -> list[bytes | memoryview]:
        st = self.store
        if isinstance(msg, wire.Attn):
            B = len(msg.req_ids)
            H, Hk, D = msg.heads
            qkv = wire.from_bytes(payload, msg.dtype, [B, H + 2 * Hk, D])

            def run() -> tuple[torch.Tensor, dict[str, str]]:
                with self.timer.timed():
                    return st.attend(msg.layer, msg.req_ids, msg.positions, qkv, H, msg.scale)

            out, errors = await self.compute.run(run)
            self.num_rows += B - len(errors)
            self.num_ctx_tokens += sum(
                p + 1
                for rid, p in zip(msg.req_ids, msg.positions, strict=True)
                if rid not in errors
            )
            for rid, why in errors.items():
                log.warning("attention of %s at layer %d not computed: %s", rid, msg.layer, why)
            head = wire.AttnOut(msg.layer, msg.req_ids, msg.dtype, H * D, errors)
            return wire.frame(head, wire.to_bytes(out))
        if isinstance(msg, wire.Offload):
            if wire.crc32(payload) != msg.crc32:
                return wire.frame(wire.Refused(msg.call, "checksum mismatch", st.free_bytes))
            kv = wire.from_bytes(payload, msg.dtype, msg.shape)
            try:
                await self.compute.run(st.put, msg.req_id, kv, msg.reserve_tokens)
            except StoreFull as exc:
                log.info("refused %s: %s", msg.req_id, exc)
                return wire.frame(wire.Refused(msg.call, f"worker full: {exc}", st.free_bytes))
            owned.add(msg.req_id)
            return wire.frame(wire.Ok(msg.call, st.free_bytes, st.stats().kv_tokens))
        if isinstance(msg, wire.Recall):
            try:
                kv = await self.compute.run(st.get, msg.req_id)
            except KeyError:
                return wire.frame(wire.Refused(msg.call, f"{msg.req_id!r} is not held here"))
            data = wire.to_bytes(kv)
            ok = wire.Ok(
                msg.call,
                st.free_bytes,
                st.stats().kv_tokens,
                shape=list(kv.shape),
                dtype=wire.dtype_name(kv.dtype),
                crc32=wire.crc32(data),
            )
            return wire.frame(ok, data)
        if isinstance(msg, wire.Hello):
            return wire.frame(wire.Ok(msg.call, st.free_bytes, st.stats().kv_tokens))
        if isinstance(msg, wire.Drop):
            st.drop(msg.req_id)
            owned.discard(msg.req_id)
            return []
        raise ValueError(f"a worker does not take {type(msg).__name__} frames")


class ThreadedWorker:
    """A worker's data plane on its own event loop in a background thread, with no bus: for
    benchmarks and tests that drive an engine directly."""

    def __init__(self, capacity_bytes: int, host: str = "127.0.0.1") -> None:
        self.store = KvStore(capacity_bytes)
        self.server = AttnServer(self.store)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(host, 0), self.loop).result(10)
        self.port = self.server.port

    def kill(self) -> None:
        """Close the listener and every connection, as a dead process would."""
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)

    def stop(self) -> None:
        self.kill()

        async def settle() -> None:  # connection tasks end before the loop does
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(settle(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
