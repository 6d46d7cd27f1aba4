"""One request's token stream in the gateway: chunks delivered strictly in `seq` order from
whichever instance runs the request now, and the request run again elsewhere when that instance
dies or the stream loses chunks (recompute from the prompt plus the tokens already streamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from nats.aio.client import Client as NATS

from services.common.client.silence import Silences
from services.common.protocol import ApiError
from tidal.policy.state import Slo
from tidal.schemas import codec, subjects
from tidal.schemas.messages import CancelRequest, GenerateAck, GenerateRequest, TokenChunk

log = logging.getLogger("tidal.gateway")

MAX_RECOMPUTES = 3  # a request survives this many lost instances
REPLACE_RETRY_S = 30.0  # a re-run copy waits this long for the bus to route it again
REPLACE_WAIT_S = 1.0
PASSING_CODES = ("scheduler_unavailable", "no_capacity")  # 503s that pass by themselves


@dataclass(frozen=True)
class _Down:
    """Queued to a request's stream when its instance dies (or its stream was cut)."""

    instance_id: str
    reason: str
    at_s: float  # monotonic time the notice came in
    exclude: bool = True  # keep the request off that instance (False: the instance is fine)


class StreamBus(Protocol):
    """What a stream uses of its bus (`bus.RequestBus`)."""

    nc: NATS
    silences: Silences
    handles: dict[str, RequestHandle]

    def release(self, handle: RequestHandle) -> None: ...

    def on_recompute(self, req_class: str) -> None: ...

    async def place(
        self, handle: RequestHandle, exclude: list[str], excluded_at_unix_s: float = 0.0
    ) -> None: ...


@dataclass
class RequestHandle:
    """A submitted request. Iterate it for its `TokenChunk`s, in order, ending with a finish."""

    bus: StreamBus
    request: GenerateRequest
    instance_id: str = ""
    ack: GenerateAck = field(default_factory=lambda: GenerateAck(ok=False))
    queue: asyncio.Queue[TokenChunk | _Down] = field(default_factory=asyncio.Queue)
    num_chunks: int = 0  # chunks delivered = the next seq expected
    is_finished: bool = False
    early: dict[int, TokenChunk] = field(default_factory=dict)  # seq -> chunk that came early
    token_ids: list[int] = field(default_factory=list)  # streamed so far (for a recompute)
    num_recomputes: int = 0
    num_migrations: int = 0
    placed_at_s: float = 0.0  # monotonic time an instance last accepted it
    placed_at_unix_s: float = 0.0  # start of the process that took it (else when it was sent)
    progress_unix_s: float = 0.0  # when it was last placed or last delivered a chunk
    reconnects_at_place: int = 0  # the bus's reconnect count when an instance accepted it
    client_req_id: str = ""  # the id the client knows (a re-run copy may have another)
    default_slo: Slo | None = None  # the scheduler's, once it routed the request

    def __post_init__(self) -> None:
        self.client_req_id = self.client_req_id or self.request.req_id

    async def batches(self) -> AsyncIterator[list[TokenChunk]]:
        """The request's chunks in order, in batches of whatever has arrived: a burst of tokens
        becomes one write to the client instead of one per token."""
        while not self.is_finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch: list[TokenChunk] = []
            for item in items:
                batch += await self._accept(item)
                if self.is_finished:
                    break
            if batch:
                yield batch

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        async for batch in self.batches():
            for chunk in batch:
                yield chunk

    async def _accept(self, item: TokenChunk | _Down) -> list[TokenChunk]:
        if isinstance(item, _Down):
            if item.instance_id != self.instance_id or item.at_s < self.placed_at_s:
                # a stale notice: about an instance this request already left, or about the
                # process that had this id before the one that took the request since
                return []
            return await self._lost(item)
        if item.req_id != self.request.req_id:
            return []
        if item.moved_to:
            if item.seq >= self.num_chunks:  # not a notice older than what we already have
                self.instance_id = item.moved_to
                self.num_migrations += 1
            return []
        if item.seq < self.num_chunks:
            return []  # already delivered (a duplicate after a migration race)
        if item.seq > self.num_chunks and self._reconnected():
            # Chunks are plain NATS messages, in order from one instance: a gap after a bus
            # outage is chunks lost in it, for good. The instance still runs the request, so
            # the stream would wait forever for them: run it again elsewhere from what the
            # client has, under a new id so that what the old copy still sends is dropped.
            why = f"chunks {self.num_chunks}..{item.seq - 1} were lost in a bus outage"
            return await self._lost(_Down(item.instance_id, why, time.monotonic()))
        self.early[item.seq] = item
        out: list[TokenChunk] = []
        while self.num_chunks in self.early:
            chunk = self.early.pop(self.num_chunks)
            self.num_chunks += 1
            self.instance_id = chunk.instance_id
            self.token_ids += chunk.token_ids
            out.append(chunk)
            self.progress_unix_s = time.time()
            if chunk.finish_reason is not None:
                self.is_finished = True
                self.bus.release(self)
                break
        return out

    def _reconnected(self) -> bool:
        """Has the bus reconnected, or the instance running the request been silent (its link
        or ours cut), since an instance last accepted the request?"""
        if self.bus.silences.was_silent_since(self.instance_id, self.placed_at_s):
            return True
        return bool(self.bus.nc.stats.get("reconnects", 0) != self.reconnects_at_place)

    async def _lost(self, down: _Down) -> list[TokenChunk]:
        """The instance running the request died (or its chunks were lost): run it elsewhere,
        resuming after what the client already has (recompute), or end it with an error if that
        keeps failing."""
        # Whatever may still run it (an instance that lost only its chunks, or one the gateway
        # did not know it had moved to) is cancelled, and the next copy runs under a new id: an
        # instance still holding the old one would refuse a copy under the same id.
        await self._abandon(down.reason)
        # NOTE: while it is placed again (which may wait on a held route), the stall sweep
        # leaves it alone: it fired every 10 s on a request being re-placed, without end
        self.progress_unix_s = 0.0
        if self.num_recomputes < MAX_RECOMPUTES:
            self.num_recomputes += 1
            self.bus.on_recompute(self.request.req_class)
            log.warning(
                "request %s lost on %s after %d token(s); recomputing elsewhere",
                self.request.req_id,
                down.instance_id,
                len(self.token_ids),
            )
            self.request = msgspec.structs.replace(
                self.request, resume_token_ids=list(self.token_ids), first_seq=self.num_chunks
            )
            self.early.clear()
            try:
                # the process that lost it started before it took the request; one started
                # since under the same id (`tidal up` restarts it) may take it again
                exclude = [down.instance_id] if down.exclude else []
                await self._place_again(exclude)
                return []
            except ApiError as exc:
                reason = f"{down.reason}; no instance took it again: {exc.message}"
            except Exception as exc:
                reason = f"{down.reason}; re-routing failed: {exc}"
        else:
            reason = f"{down.reason} ({self.num_recomputes} recomputes already)"
        self.is_finished = True
        self.bus.release(self)
        return [
            TokenChunk(
                req_id=self.request.req_id,
                seq=self.num_chunks,
                text="",
                num_tokens=0,
                num_prompt_tokens=self.ack.num_prompt_tokens,
                num_output_tokens=0,
                instance_id=down.instance_id,
                finish_reason="error",
                error=f"instance {down.instance_id} failed mid-request: {reason}",
            )
        ]

    async def _place_again(self, exclude: list[str]) -> None:
        """Place the re-run copy, waiting out a bus that is still knitting itself together
        (routes between NATS nodes come back seconds after a cut link: the scheduler has no
        responders meanwhile) for up to `REPLACE_RETRY_S`; the client has part of its answer
        and would rather wait than get an error."""
        deadline = time.monotonic() + REPLACE_RETRY_S
        while True:
            try:
                await self.bus.place(self, exclude, self.placed_at_unix_s)
                return
            except ApiError as exc:
                passing = exc.status == 503 and exc.code in PASSING_CODES
                if not passing or time.monotonic() + REPLACE_WAIT_S > deadline:
                    raise
                log.warning("re-run of %s waits: %s", self.request.req_id, exc.message)
                await asyncio.sleep(REPLACE_WAIT_S)

    async def _abandon(self, reason: str) -> None:
        """Cancel the copy that still runs and take a new id for the next one."""
        old = self.request.req_id
        with contextlib.suppress(Exception):  # best effort: the bus may be down right now
            await self.bus.nc.publish(subjects.CANCEL, codec.encode(CancelRequest(old, reason)))
        self.bus.silences.abandon(old)
        new = f"{self.client_req_id}.r{self.num_recomputes + 1}"
        self.request = msgspec.structs.replace(self.request, req_id=new)
        self.bus.handles.pop(old, None)
        self.bus.handles[new] = self

    async def cancel(self, reason: str = "client disconnected") -> None:
        if self.is_finished:
            return
        self.is_finished = True
        self.bus.release(self)
        msg = CancelRequest(req_id=self.request.req_id, reason=reason)
        await self.bus.nc.publish(subjects.CANCEL, codec.encode(msg))
