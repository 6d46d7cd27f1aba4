"""One `--engine sglang` instance over an SGLang prefill/decode pair (PD disaggregation).

Issue 14's "push migration -> SGLang's PD disaggregation". SGLang picks the PD pair of a request
when it is admitted, and cannot move a running decode between servers; so the push that Tidal
does itself on its own engine (prefill on one instance, KV pushed, decode on another) is carried
out here by SGLang inside one instance that drives two servers: `--sglang-url` runs with
`--disaggregation-mode prefill`, `--sglang-decode-url` with `--disaggregation-mode decode`.
Every submission goes to both with the same `bootstrap_host`/`bootstrap_port`/`bootstrap_room`,
as SGLang's routers send it (`services.instance.sglang.api`, "PD disaggregation", for what they do
and what SGLang 0.5.23's source says); the prefill server computes the prompt and its transfer
backend (mooncake, nixl, ...) pushes the KV to the decode server, whose stream is read exactly
as a single server's is (`SglangClient`). Tidal's own migrate and pull commands for such an
instance stay recompute migrations: the engine's abort reaches both servers (`/abort_request`,
the same rid at each), and the target resubmits prompt + generated ids.

What differs from SGLang's routers, and why:

- the prefill server gets `stream: false` (the routers forward the client's flag): the worker
  reads only how it ended, one JSON answer after the KV was sent;
- its answer is read, not drained: a prefill that fails (an HTTP error, SGLang's abort, no answer
  within `handoff_timeout_s`) ends the decode's wait at once: the decode submission is aborted at
  both servers and ends, for the engine, as an SGLang abort does ("SGLang abort: ..."), so the
  request is requeued with its tokens, and fails after `MAX_SGLANG_ABORTS` of them. Without this
  the decode server would wait `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` (300 s) for the room;
- a decode stream that brings no token within `handoff_timeout_s` after the prefill answered is
  ended the same way.

Each handoff is counted: `num_handoffs` when the prefill answered and the decode stream brought
its first token (the KV arrived and decoding started), `num_handoff_failures` otherwise (the
request itself is requeued as above). They ride the instance heartbeat's `info` and the gateway
counts them in `tidal_migrations_total{kind="push", mode="pd_transfer"}`.

Load: the decode server's `/v1/loads` bounds what the pair can hold: its KV pool is where a
request lives while it decodes (the prefill's KV is released once sent), and its waiting count
already holds every request whose KV has not landed (its prealloc and transfer queues,
`managers/scheduler_components/load_inquirer.py`). So running, KV used/total and throughput are
the decode server's; waiting is the larger of the decode's and the prefill's queued + running
(a request sits in both at once, so adding them would count it twice); the prefill server's own
figures go into `info`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from services.instance.sglang.api import (
    DEFAULT_HANDOFF_TIMEOUT_S,
    SglangLoad,
    bootstrap_host_of,
    new_bootstrap_room,
    pd_prefill_body,
    prefill_outcome,
)
from services.instance.sglang.client import SglangClient, StreamMsg
from tidal.schemas.messages import PD_MIGRATION_MODE

log = logging.getLogger("tidal.instance.sglang")


@dataclass
class _Handoff:
    """One PD submission's handoff, on the client's loop."""

    req_id: str
    first: asyncio.Event = field(default_factory=asyncio.Event)  # the decode stream spoke or ended
    decoded: bool = False  # its first message brought tokens


class PdPairClient(SglangClient):
    """`SglangClient` over a prefill server and a decode server; `base_url` is the decode's."""

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        bootstrap_port: int,
        timeout_s: float = 10.0,
        handoff_timeout_s: float = DEFAULT_HANDOFF_TIMEOUT_S,
    ) -> None:
        if handoff_timeout_s <= 0:
            raise ValueError(f"handoff_timeout_s must be > 0, got {handoff_timeout_s}")
        self.prefill_url = prefill_url.rstrip("/")
        self.bootstrap_host = bootstrap_host_of(self.prefill_url)
        self.bootstrap_port = bootstrap_port
        self.handoff_timeout_s = handoff_timeout_s
        self.decode_load = SglangLoad()
        self.prefill_load = SglangLoad()
        self.num_handoffs = 0  # prefill answered and the decode stream brought tokens
        self.num_handoff_failures = 0
        self._prefill_http: httpx.AsyncClient | None = None
        self._handoffs: dict[str, _Handoff] = {}  # rid -> its handoff, until the prefill ends
        super().__init__(decode_url, timeout_s)

    async def _open(self) -> None:
        await super()._open()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._prefill_http = httpx.AsyncClient(
            base_url=self.prefill_url, timeout=httpx.Timeout(self.timeout_s), limits=limits
        )
        self._tasks["__prefill_loads__"] = asyncio.create_task(
            self._poll_loads(self._prefill_http, self._on_prefill_load, "SGLang prefill")
        )

    def info(self) -> dict[str, str]:
        p = self.prefill_load
        return {
            "sglang_prefill_url": self.prefill_url,
            "sglang_prefill_running": str(p.num_running),
            "sglang_prefill_waiting": str(p.num_waiting),
            "sglang_prefill_token_usage": f"{p.token_usage:.4f}",
            "sglang_bootstrap": f"{self.bootstrap_host}:{self.bootstrap_port}",
            "migration_mode_pd": PD_MIGRATION_MODE,  # prefill -> decode, at admission
            "pd_transfers_total": str(self.num_handoffs),
            "pd_transfer_failures_total": str(self.num_handoff_failures),
        }

    # ---- load ----

    def _on_load(self, load: SglangLoad) -> None:
        self.decode_load = load
        self._combine()

    def _on_prefill_load(self, load: SglangLoad) -> None:
        self.prefill_load = load
        self._combine()

    def _combine(self) -> None:
        d, p = self.decode_load, self.prefill_load
        self.load = replace(d, num_waiting=max(d.num_waiting, p.num_waiting + p.num_running))

    # ---- submissions (on the client's loop) ----

    def _start(self, req_id: str, rid: str, body: dict[str, Any]) -> None:
        room = new_bootstrap_room()
        pd = {
            **body,
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": room,
        }
        self._handoffs[rid] = _Handoff(req_id)
        super()._start(req_id, rid, pd)
        self._tasks[_prefill_key(rid)] = asyncio.create_task(self._prefill(req_id, rid, pd))

    def _put(self, msg: StreamMsg) -> None:
        h = self._handoffs.get(msg.rid)
        if h is not None and not h.first.is_set():
            h.decoded = msg.obj is not None and bool(msg.obj.get("output_ids"))
            h.first.set()
        super()._put(msg)

    async def _prefill(self, req_id: str, rid: str, body: dict[str, Any]) -> None:
        h = self._handoffs[rid]
        try:
            why = await self._prefill_answer(body)
            if not why:
                try:
                    await asyncio.wait_for(h.first.wait(), self.handoff_timeout_s)
                except TimeoutError:
                    why = (
                        f"the decode server brought no token {self.handoff_timeout_s:g} s after "
                        "the prefill server sent the KV"
                    )
                else:
                    if h.decoded:
                        self.num_handoffs += 1
                        return
                    why = "the decode server ended it before its first token"
            self.num_handoff_failures += 1
            self._fail(req_id, rid, why)
        finally:
            self._handoffs.pop(rid, None)
            self._tasks.pop(_prefill_key(rid), None)

    async def _prefill_answer(self, body: dict[str, Any]) -> str:
        """ "" once the prefill server says it sent the KV; else why not."""
        assert self._prefill_http is not None
        try:
            r = await asyncio.wait_for(
                self._prefill_http.post("/generate", json=pd_prefill_body(body), timeout=None),
                self.handoff_timeout_s,
            )
        except TimeoutError:
            return f"the prefill server did not answer within {self.handoff_timeout_s:g} s"
        except httpx.HTTPError as exc:
            return f"prefill server {self.prefill_url}: {type(exc).__name__}: {exc}"
        try:
            obj: Any = r.json()
        except ValueError:
            obj = r.text
        return prefill_outcome(r.status_code, obj)

    def _fail(self, req_id: str, rid: str, why: str) -> None:
        """End the decode side of a handoff that cannot happen: stop its stream, abort it at
        both servers, and hand the engine an end shaped as SGLang's own abort."""
        task = self._tasks.pop(rid, None)
        if task is None:
            return  # the decode stream ended already (or the engine aborted it)
        log.warning("PD handoff of %s failed: %s", req_id, why)
        task.cancel()
        self._abort_both(rid)
        meta = {"finish_reason": {"type": "abort", "message": why}}
        self._put(StreamMsg(req_id, rid, {"text": "", "output_ids": [], "meta_info": meta}))

    def _abort_soon(self, rid: str) -> None:
        prefill = self._tasks.pop(_prefill_key(rid), None)
        if prefill is not None:
            prefill.cancel()
        self._handoffs.pop(rid, None)
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()
        self._abort_both(rid)

    def _abort_both(self, rid: str) -> None:
        for http in (self._http, self._prefill_http):
            self._aborts.add(t := asyncio.create_task(self._post_abort(rid, http)))
            t.add_done_callback(self._aborts.discard)

    async def _close(self) -> None:
        await super()._close()
        if self._prefill_http is not None:
            await self._prefill_http.aclose()


def _prefill_key(rid: str) -> str:
    return rid + "/prefill"
