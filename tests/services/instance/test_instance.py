from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.aio.client import Client as NATS

from tests.services.instance.instance_kit import GW, heartbeat_load, make_req, submit
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    CancelRequest,
    GenerateRequest,
    SamplingSpec,
    TokenChunk,
)

pytestmark = pytest.mark.nats


async def test_streams_every_token_in_order_then_finishes(instance: NATS) -> None:
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def on_chunk(msg) -> None:  # type: ignore[no-untyped-def]
        chunks.append(codec.decode(msg.data, TokenChunk))
        if chunks[-1].finish_reason:
            done.set()

    await instance.subscribe(GW, cb=on_chunk)
    ack = await submit(instance, make_req("a", max_tokens=5))
    assert ack.ok and ack.is_emulated and ack.engine == "sim" and ack.num_prompt_tokens > 0
    await asyncio.wait_for(done.wait(), 5)
    assert [c.seq for c in chunks] == list(range(5))
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 5
    assert all(c.is_emulated and c.instance_id == "inst-t" for c in chunks)


async def test_cancel_stops_the_request_and_frees_it(instance: NATS) -> None:
    chunks: list[TokenChunk] = []

    async def on_chunk(msg) -> None:  # type: ignore[no-untyped-def]
        chunks.append(codec.decode(msg.data, TokenChunk))

    await instance.subscribe(GW, cb=on_chunk)
    assert (await submit(instance, make_req("long", max_tokens=200))).ok
    await asyncio.sleep(0.2)
    await instance.publish(subjects.CANCEL, codec.encode(CancelRequest(req_id="long")))
    await asyncio.sleep(0.3)
    n = len(chunks)
    await asyncio.sleep(0.3)
    assert 0 < n < 200 and len(chunks) == n  # nothing more after the cancel
    status = await heartbeat_load(instance)
    assert status["num_running"] == 0 and status["num_kv_blocks_used"] == 0


async def test_the_same_request_sent_again_runs_once_and_is_acked_again(instance: NATS) -> None:
    """A gateway whose first ack was lost in a cut link sends the request again: it runs (or
    ran) here already, so the answer is the same ack, and its tokens come once. Another
    gateway's copy of the same id is refused as a duplicate."""
    chunks: list[TokenChunk] = []

    async def on_chunk(msg) -> None:  # type: ignore[no-untyped-def]
        chunks.append(codec.decode(msg.data, TokenChunk))

    await instance.subscribe(GW, cb=on_chunk)
    first = await submit(instance, make_req("again", max_tokens=40))
    again = await submit(instance, make_req("again", max_tokens=40))
    assert first.ok and again.ok and again.num_prompt_tokens == first.num_prompt_tokens
    other = msgspec.structs.replace(
        make_req("again", max_tokens=40), reply_subject=subjects.gateway_tokens("gw-other")
    )
    refused = await submit(instance, other)
    assert not refused.ok and refused.error_code == "duplicate"
    for _ in range(100):
        if chunks and chunks[-1].finish_reason:
            break
        await asyncio.sleep(0.05)
    assert [c.seq for c in chunks] == list(range(40))
    late = await submit(instance, make_req("again", max_tokens=40))  # after it finished here
    assert late.ok
    await asyncio.sleep(0.5)
    assert len(chunks) == 40  # acked, not run a second time


async def test_rejects_bad_requests_with_a_reason(instance: NATS) -> None:
    too_long = await submit(instance, make_req("big", max_tokens=1000))
    assert not too_long.ok and too_long.error_code == "context_length_exceeded"
    clipped = await submit(
        instance,
        GenerateRequest(
            req_id="clip",
            model="tidal-sim",
            reply_subject=GW,
            prompt="hi",
            sampling=SamplingSpec(max_tokens=1000, max_tokens_is_default=True),
        ),
    )
    assert clipped.ok
    bad_reply = await submit(
        instance,
        GenerateRequest(
            req_id="x",
            model="tidal-sim",
            reply_subject="elsewhere",
            prompt="hi",
            sampling=SamplingSpec(max_tokens=3),
        ),
    )
    assert not bad_reply.ok and bad_reply.error_code == "invalid_request"
    empty = await submit(
        instance,
        GenerateRequest(
            req_id="e",
            model="tidal-sim",
            reply_subject=GW,
            prompt="",
            sampling=SamplingSpec(max_tokens=3),
        ),
    )
    assert not empty.ok and "empty" in empty.message
