"""A request's stream (`services/common/client/stream.py`, the gateway's and the batch
service's) on a hand-driven bus: chunks lost in a bus outage while the instance still runs the
request make it run again, and the old copy is cut."""

from __future__ import annotations

import asyncio
from typing import Any

from services.common.client import stream
from services.common.client.silence import Silences
from services.common.client.stream import RequestHandle
from services.common.protocol import ApiError
from tidal.schemas import codec, subjects
from tidal.schemas.messages import CancelRequest, GenerateRequest, SamplingSpec, TokenChunk


class FakeNats:
    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))


class FakeBus:
    """What a RequestHandle asks of its RequestBus; `place` puts it on instance i1."""

    def __init__(self) -> None:
        self.nc = FakeNats()
        self.recomputes: list[str] = []
        self.handles: dict[str, RequestHandle] = {}
        self.placed: list[tuple[GenerateRequest, list[str]]] = []
        self.silences = Silences(heartbeat_s=0.5, on_back=lambda *_: None)
        self.num_unroutable = 0  # places that fail with 503 before one succeeds

    def release(self, handle: RequestHandle) -> None:
        self.handles.pop(handle.request.req_id, None)

    def on_recompute(self, req_class: str) -> None:
        self.recomputes.append(req_class)

    async def place(self, handle: RequestHandle, exclude: list[str], at: float = 0.0) -> None:
        if self.num_unroutable > 0:  # the bus has no route to a scheduler yet
            self.num_unroutable -= 1
            raise ApiError(503, "the scheduler is not reachable", code="scheduler_unavailable")
        self.placed.append((handle.request, exclude))
        handle.instance_id = "i1"
        handle.reconnects_at_place = self.nc.stats["reconnects"]


def chunk(req_id: str, seq: int, inst: str, finish: str | None = None) -> TokenChunk:
    return TokenChunk(req_id, seq, f" w{seq}", 1, 3, seq + 1, inst, finish_reason=finish,
                      token_ids=[100 + seq])  # fmt: skip


def handle() -> tuple[FakeBus, RequestHandle]:
    bus = FakeBus()
    req = GenerateRequest("r1", "m", SamplingSpec(max_tokens=8), "tidal.gw.g.tokens")
    h = RequestHandle(bus=bus, request=req, instance_id="i0")  # type: ignore[arg-type]
    bus.handles["r1"] = h
    return bus, h


async def _take(h: RequestHandle, *chunks: Any) -> list[str]:
    out: list[str] = []
    for c in chunks:
        out += [x.text for x in await h._accept(c)]
    return out


def test_a_gap_after_a_bus_reconnect_reruns_the_request_and_drops_the_old_copy() -> None:
    async def go() -> None:
        bus, h = handle()
        assert await _take(h, chunk("r1", 0, "i0"), chunk("r1", 1, "i0")) == [" w0", " w1"]
        bus.nc.stats["reconnects"] = 1  # nats-server restarted: chunks 2 and 3 were lost
        assert await _take(h, chunk("r1", 4, "i0")) == []
        ((subject, data),) = bus.nc.published
        assert subject == subjects.CANCEL and codec.decode(data, CancelRequest).req_id == "r1"
        ((again, exclude),) = bus.placed
        assert again.req_id == "r1.r1" and exclude == ["i0"]
        assert again.resume_token_ids == [100, 101] and again.first_seq == 2
        assert set(bus.handles) == {"r1.r1"} and h.client_req_id == "r1"
        # the old copy's chunks (old id) are dropped; the new copy's continue the stream
        late = await _take(h, chunk("r1", 5, "i0"), chunk("r1.r1", 2, "i1"),
                           chunk("r1.r1", 3, "i1", finish="length"))  # fmt: skip
        assert late == [" w2", " w3"] and h.is_finished and h.num_recomputes == 1

    asyncio.run(go())


def test_a_gap_after_its_instance_fell_silent_reruns_it_without_a_reconnect() -> None:
    """A cut link (the instance's or the gateway's own NATS node's) drops chunks while this
    connection stays up: the instance's silence makes the gap final, as a reconnect does."""

    async def go() -> None:
        bus, h = handle()
        h.placed_at_s = 10.0
        assert await _take(h, chunk("r1", 0, "i0")) == [" w0"]
        bus.silences.back_s["i1"] = 20.0  # another instance's silence says nothing of this stream
        assert await _take(h, chunk("r1", 2, "i0")) == [] and bus.placed == []
        bus.silences.back_s["i0"] = 20.0  # i0 unheard for seconds, then heard again
        assert await _take(h, chunk("r1", 3, "i0")) == []
        ((again, _),) = bus.placed
        assert again.req_id == "r1.r1" and again.resume_token_ids == [100]
        assert list(bus.silences.abandoned) == ["r1"]  # cancelled again if i0 still reports it

    asyncio.run(go())


def test_a_rerun_waits_for_the_bus_to_route_again_instead_of_failing(monkeypatch: Any) -> None:
    """Right after a cut link returns, NATS routes are still reconnecting and the scheduler
    has no responders: the re-run copy waits for it rather than ending the stream."""
    monkeypatch.setattr(stream, "REPLACE_WAIT_S", 0.01)

    async def go() -> None:
        bus, h = handle()
        bus.num_unroutable = 2
        assert await _take(h, chunk("r1", 0, "i0")) == [" w0"]
        bus.nc.stats["reconnects"] = 1
        assert await _take(h, chunk("r1", 2, "i0")) == []
        ((again, _),) = bus.placed
        assert again.req_id == "r1.r1" and not h.is_finished and h.num_recomputes == 1

    asyncio.run(go())


def test_without_a_reconnect_an_early_chunk_waits_for_the_one_before_it() -> None:
    async def go() -> None:
        bus, h = handle()
        assert await _take(h, chunk("r1", 1, "i0")) == []  # a migration race, not a loss
        assert await _take(h, chunk("r1", 0, "i0")) == [" w0", " w1"]
        assert bus.placed == [] and bus.nc.published == []

    asyncio.run(go())


def test_an_instance_that_did_not_answer_is_excluded_as_the_process_routed_to() -> None:
    """The process the scheduler routed to failed it, not one started since (a restart)."""
    import nats.errors

    from services.common.client.bus import RequestBus
    from tidal.schemas.messages import GenerateAck, RouteReply

    class Reply:
        data = codec.encode(GenerateAck(ok=True))

    class Nc(FakeNats):
        calls = 0

        async def request(self, subject: str, data: bytes, timeout: float) -> Reply:
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(0.3)  # the submit times out
                raise nats.errors.TimeoutError
            return Reply()

    async def go() -> None:
        bus = RequestBus(Nc(), "g", 8)  # type: ignore[arg-type]
        asked: list[tuple[list[str], float]] = []

        async def route(
            req: GenerateRequest, exclude: list[str], at: float, tokens: int = 0
        ) -> RouteReply:
            asked.append((list(exclude), at))
            return RouteReply(instance_id="i0", instance_started_unix_s=123.0)

        bus._route = route  # type: ignore[method-assign]
        _, h = handle()
        await bus.place(h, [])
        (first, _), (again, excluded_at) = asked
        assert first == [] and again == ["i0"]
        assert excluded_at == 123.0  # that process, not the time the failure showed
        assert h.placed_at_unix_s == 123.0

    asyncio.run(go())
