"""HTTP to one SGLang server, on a private asyncio loop in its own thread.

The engine interface is synchronous (the instance calls `step` from a worker thread), while
SGLang streams every request over its own HTTP response; so this client runs the streams on a
loop of its own and hands what they bring back through a thread-safe inbox. The worker never
imports `sglang`: it speaks `services.instance.sglang.api`'s subset of SGLang's HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx

from services.instance.sglang.api import SglangLoad, parse_loads

log = logging.getLogger("tidal.instance.sglang")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request and per poll

LOADS_INTERVAL_S = 0.25  # how often /v1/loads is read


STREAM_IDLE_TIMEOUT_S = 300.0  # longest silence of a /generate stream before it is given up


@dataclass(frozen=True)
class StreamMsg:
    """One thing a `/generate` stream brought: a decoded chunk, or its end (`obj` None)."""

    req_id: str
    rid: str
    obj: dict[str, Any] | None


class SglangClient:
    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.inbox: queue.SimpleQueue[StreamMsg] = queue.SimpleQueue()
        self.arrived = threading.Event()  # set whenever the inbox gains something
        self.load = SglangLoad()
        self.load_error = ""
        self.loop = asyncio.new_event_loop()
        self._http: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}  # rid -> its stream
        self._aborts: set[asyncio.Task[None]] = set()  # /abort_request posts under way
        self._thread = threading.Thread(target=self._run, name="sglang-client", daemon=True)
        self._thread.start()
        self._call(self._open()).result()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _open(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(self.timeout_s), limits=limits
        )
        self._tasks["__loads__"] = asyncio.create_task(
            self._poll_loads(self._http, self._on_load, "SGLang")
        )

    # ---- called from any thread ----

    def get_json(self, path: str) -> Any:
        return self._call(self._get_json(path)).result(self.timeout_s + 1)

    def submit(self, req_id: str, rid: str, body: dict[str, Any]) -> None:
        """Start streaming `body` from `/generate`; its chunks arrive in `inbox`."""
        self.loop.call_soon_threadsafe(self._start, req_id, rid, body)

    def abort(self, rid: str) -> None:
        """Stop `rid` in SGLang (`/abort_request`) and stop reading its stream."""
        self.loop.call_soon_threadsafe(self._abort_soon, rid)

    def info(self) -> dict[str, str]:
        """What this client adds to the instance heartbeat's `info` (nothing for one server)."""
        return {}

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self._call(self._close()).result(self.timeout_s + 1)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

    # ---- on the client's loop ----

    async def _get_json(self, path: str) -> Any:
        assert self._http is not None
        r = await self._http.get(path)
        r.raise_for_status()
        return r.json()

    def _start(self, req_id: str, rid: str, body: dict[str, Any]) -> None:
        self._tasks[rid] = asyncio.create_task(self._stream(req_id, rid, body))

    def _abort_soon(self, rid: str) -> None:
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()
        self._aborts.add(t := asyncio.create_task(self._post_abort(rid)))
        t.add_done_callback(self._aborts.discard)

    async def _post_abort(self, rid: str, http: httpx.AsyncClient | None = None) -> None:
        http = http or self._http
        assert http is not None
        try:
            r = await http.post("/abort_request", json={"rid": rid})
            if r.status_code != 200:
                log.warning("SGLang refused to abort %s: HTTP %d", rid, r.status_code)
        except httpx.HTTPError as exc:
            log.warning("abort of %s not sent to SGLang at %s: %s", rid, http.base_url, exc)

    def _put(self, msg: StreamMsg) -> None:
        self.inbox.put(msg)
        self.arrived.set()

    async def _stream(self, req_id: str, rid: str, body: dict[str, Any]) -> None:
        assert self._http is not None
        try:
            # NOTE: no chunk for STREAM_IDLE_TIMEOUT_S (a hung server) ends the stream with an
            # error, handled as an SGLang abort (requeued, failed after a few); a long prefill
            # or a wait behind retractions stays well inside it.
            timeout = httpx.Timeout(self.timeout_s, read=STREAM_IDLE_TIMEOUT_S)
            async with self._http.stream("POST", "/generate", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:500]
                    err = {"message": f"HTTP {r.status_code}: {text}"}
                    self._put(StreamMsg(req_id, rid, {"error": err}))
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        log.warning("dropped a malformed SGLang chunk for %s: %.80s", rid, data)
                        continue
                    if isinstance(obj, dict):
                        self._put(StreamMsg(req_id, rid, obj))
        except asyncio.CancelledError:
            raise
        except httpx.HTTPError as exc:
            err = {"message": f"{type(exc).__name__}: {exc}"}
            self._put(StreamMsg(req_id, rid, {"error": err}))
        finally:
            self._tasks.pop(rid, None)
            self._put(StreamMsg(req_id, rid, None))

    def _on_load(self, load: SglangLoad) -> None:
        self.load = load

    async def _poll_loads(
        self, http: httpx.AsyncClient, on_load: Callable[[SglangLoad], None], what: str
    ) -> None:
        error = ""
        while True:
            try:
                r = await http.get("/v1/loads")
                r.raise_for_status()
                on_load(parse_loads(r.json()))
                error = ""
            except (httpx.HTTPError, ValueError, TypeError) as exc:
                if not error:
                    log.warning("%s /v1/loads unreadable: %s", what, exc)
                error = str(exc)
            self.load_error = error
            await asyncio.sleep(LOADS_INTERVAL_S)

    async def _close(self) -> None:
        await asyncio.gather(*self._aborts, return_exceptions=True)  # let aborts reach SGLang
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._http is not None:
            await self._http.aclose()
