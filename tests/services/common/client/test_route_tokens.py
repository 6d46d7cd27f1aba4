"""What the gateway tells the scheduler of a prompt's length: characters on a first placement
(the gateway does not tokenise), the token count once an instance has reported it (a request
placed again after a lost instance: its prompt plus the tokens already streamed)."""

from __future__ import annotations

import asyncio

import msgspec

from services.common.client.bus import RequestBus
from services.common.client.stream import RequestHandle
from tidal.schemas import codec
from tidal.schemas.messages import (
    GenerateAck,
    GenerateRequest,
    RouteReply,
    RouteRequest,
    SamplingSpec,
)


class Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data


class Nc:
    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.max_payload = 1 << 20

    async def request(self, subject: str, data: bytes, timeout: float) -> Reply:
        return Reply(codec.encode(GenerateAck(ok=True, num_prompt_tokens=7)))


def test_a_re_placed_request_is_routed_on_its_token_count() -> None:
    async def go() -> None:
        bus = RequestBus(Nc(), "g", 8)  # type: ignore[arg-type]
        asks: list[RouteRequest] = []

        async def ask_route(ask: RouteRequest, timeout_s: float) -> Reply:
            asks.append(ask)
            return Reply(codec.encode(RouteReply(instance_id="i0")))

        bus._ask_route = ask_route  # type: ignore[method-assign,assignment]
        req = GenerateRequest(
            req_id="r", model="m", sampling=SamplingSpec(max_tokens=5), reply_subject="x",
            prompt="hello world, hello world",
        )  # fmt: skip
        h = RequestHandle(bus, req)  # type: ignore[arg-type]
        await bus.place(h, [])
        assert asks[0].num_prompt_chars == 24 and asks[0].num_prompt_tokens == 0
        # Lost after 3 tokens: placed again with them as input.
        h.request = msgspec.structs.replace(req, resume_token_ids=[1, 2, 3])
        await bus.place(h, ["i0"], 1.0)
        assert asks[1].num_prompt_tokens == 7 + 3

    asyncio.run(go())
