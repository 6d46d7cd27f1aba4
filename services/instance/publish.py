"""An instance's outbound tokens: each engine event becomes a chunk on its request's gateway
subject, in `seq` order; an online request's go out at once, an offline request's are held and
sent together (`chunks.Coalescing`), and a finished request is forgotten once its last chunk
is out. Mixed into `worker.Instance`, which owns the state below."""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS

from services.instance.chunks import Coalescing, Stream, build_chunk
from services.instance.policy_adapter import PolicyAdapter
from tidal.engine.api import ControllableEngine, FinishReason, TokenEvent
from tidal.schemas import codec


class Publisher:
    nc: NATS
    id: str
    engine: ControllableEngine
    adapter: PolicyAdapter
    coalescing: Coalescing
    streams: dict[str, Stream]  # req_id -> where its tokens go
    finished_ids: list[str]  # ended since the last report
    placement_due: bool
    # The last step's events, noted but not yet published: with overlap they go out while the
    # next step computes (`overlap.py`); whatever takes a request away flushes its own first.
    unsent: list[TokenEvent]

    async def _send_unsent(self) -> None:
        events, self.unsent = self.unsent, []
        if events:
            await self._send_events(events)

    async def _publish(self, events: list[TokenEvent]) -> None:
        self._note(events)
        await self._send_events(events)

    def _note(self, events: list[TokenEvent], now: float | None = None) -> None:
        """What the policy must know of `events` before it plans again (each request's token
        times, and whether a first token calls for a report at once); no I/O. The instance
        notes a step's events as soon as the step returns and publishes them while the next
        step computes (`worker.Instance.run`)."""
        now = time.time() if now is None else now
        for ev in events:
            stream = self.streams.get(ev.req_id)
            if stream is None:
                continue
            self.adapter.on_tokens(ev.req_id, now, len(ev.token_ids))  # now, held or not
            if stream.seq == 0 and ev.token_ids and ev.finish_reason is None:
                self.placement_due = True  # online or offline: see `placement_due`

    async def _send_events(self, events: list[TokenEvent]) -> None:
        """Publish noted `events` on their requests' gateway subjects (an offline request's
        held back while `chunks.Coalescing` allows)."""
        now = time.time()
        coalesce = self.coalescing.is_on
        for ev in events:
            stream = self.streams.get(ev.req_id)
            if stream is None:
                continue
            meta = self.adapter.meta.get(ev.req_id)
            is_online = meta is not None and meta.slo is not None
            if ev.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                # NOTE: a failed end goes alone, after what is held: a client is sent the
                # error instead of a failing chunk's text (`gateway.routers.openai`)
                await self._send(ev.req_id, stream)
            stream.hold(build_chunk(ev, stream, self.id, self.engine), now)
            held_back = coalesce and not is_online and ev.finish_reason is None
            if held_back and not stream.is_due(now, self.coalescing):
                continue  # an offline request's tokens go out together (`chunks.py`)
            await self._send(ev.req_id, stream)
        await self.flush_due(now=now)

    async def _send(self, req_id: str, stream: Stream) -> None:
        """Publish what `stream` holds as one chunk; a finished request is forgotten here."""
        chunk = stream.take()
        if chunk is None:
            return
        if chunk.finish_reason is not None:
            self.streams.pop(req_id, None)
            self.adapter.meta.pop(req_id, None)
            self.finished_ids.append(req_id)
        await self.nc.publish(stream.reply_subject, codec.encode(chunk))

    async def flush(self, req_id: str) -> None:
        """Publish what `req_id` holds back now, its unsent tokens included (it is about to
        leave this instance)."""
        mine = [ev for ev in self.unsent if ev.req_id == req_id]
        if mine:
            self.unsent = [ev for ev in self.unsent if ev.req_id != req_id]
            await self._send_events(mine)
        stream = self.streams.get(req_id)
        if stream is not None:
            await self._send(req_id, stream)

    async def flush_due(self, everything: bool = False, now: float | None = None) -> None:
        """Publish the held tokens that have waited long enough (all of them: `everything`)."""
        now = time.time() if now is None else now
        for req_id, stream in list(self.streams.items()):
            if stream.held and (everything or stream.is_due(now, self.coalescing)):
                await self._send(req_id, stream)
