"""`RequestBus.place` across a cut link: a submit that found no route to an instance just back
from a silence is sent to it again (the instance did not fail it: excluding it held a re-run
copy whose only fit it was until the scheduler's max hold); an instance heard all along that
does not answer is excluded, as before."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors

from services.common.client import bus as bus_client
from services.common.client.bus import RequestBus
from services.common.client.stream import RequestHandle
from tests.services.common.client.test_route_tokens import Reply
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    GenerateAck,
    GenerateRequest,
    RouteReply,
    RouteRequest,
    SamplingSpec,
)


class Nc:
    """Submits time out `num_lost` times, then are acked."""

    def __init__(self, num_lost: int) -> None:
        self.stats = {"reconnects": 0}
        self.max_payload = 1 << 20
        self.num_lost = num_lost
        self.sent: list[str] = []

    async def request(self, subject: str, data: bytes, timeout: float) -> Reply:
        self.sent.append(subject)
        if len(self.sent) <= self.num_lost:
            raise nats.errors.TimeoutError
        return Reply(codec.encode(GenerateAck(ok=True, num_prompt_tokens=7)))


def place(nc: Nc, before: object = None) -> list[RouteRequest]:
    async def go() -> list[RouteRequest]:
        bus = RequestBus(nc, "g", 8)  # type: ignore[arg-type]
        asks: list[RouteRequest] = []

        async def ask_route(ask: RouteRequest, timeout_s: float) -> Reply:
            asks.append(msgspec.structs.replace(ask, exclude=list(ask.exclude)))
            return Reply(codec.encode(RouteReply(instance_id="i0" if len(asks) == 1 else "i1")))

        bus._ask_route = ask_route  # type: ignore[method-assign,assignment]
        if callable(before):
            before(bus)
        req = GenerateRequest(
            req_id="r", model="m", sampling=SamplingSpec(max_tokens=5), reply_subject="x",
            prompt="hello",
        )  # fmt: skip
        await bus.place(RequestHandle(bus, req), [])  # type: ignore[arg-type]
        return asks

    return asyncio.run(go())


def test_a_submit_lost_across_a_link_just_back_goes_to_the_same_instance_again() -> None:
    def just_back(bus: RequestBus) -> None:
        bus.silences.heard("i0", time.monotonic() - 30.0)
        bus.silences.heard("i0")  # heard again now, after 30 s of silence

    nc = Nc(num_lost=1)
    asks = place(nc, just_back)
    assert [a.exclude for a in asks] == [[]]  # not excluded: the same route, sent again
    assert nc.sent == [subjects.instance_submit("i0")] * 2


def test_an_instance_heard_all_along_that_does_not_answer_is_excluded() -> None:
    def heard(bus: RequestBus) -> None:
        bus.silences.heard("i0")

    nc = Nc(num_lost=1)
    asks = place(nc, heard)
    assert [a.exclude for a in asks] == [[], ["i0"]]
    assert nc.sent[-1] == subjects.instance_submit("i1")


def test_a_submit_to_a_silent_instance_waits_for_it_to_be_heard(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(bus_client, "UNTIL_HEARD_S", 5.0)

    def silent(bus: RequestBus) -> None:
        bus.silences.heard("i0", time.monotonic() - 30.0)
        asyncio.get_running_loop().call_later(0.3, bus.silences.heard, "i0")

    nc = Nc(num_lost=0)
    t0 = time.monotonic()
    assert len(place(nc, silent)) == 1
    assert time.monotonic() - t0 > 0.25 and nc.sent == [subjects.instance_submit("i0")]


def test_an_instance_still_unheard_after_the_wait_is_not_sent_to_but_excluded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(bus_client, "UNTIL_HEARD_S", 0.3)

    def silent(bus: RequestBus) -> None:
        bus.silences.heard("i0", time.monotonic() - 30.0)  # and never again

    nc = Nc(num_lost=0)
    asks = place(nc, silent)
    assert [a.exclude for a in asks] == [[], ["i0"]]
    assert nc.sent == [subjects.instance_submit("i1")]
