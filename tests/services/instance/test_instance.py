from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import connect
from services.instance import main as instance_main
from services.instance import worker
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    CancelRequest,
    ChatMessage,
    GenerateAck,
    GenerateRequest,
    InstanceReport,
    SamplingSpec,
    TokenChunk,
)

pytestmark = pytest.mark.nats
GW = subjects.gateway_tokens("gw-test")


@pytest.fixture
async def instance(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NATS]:
    monkeypatch.setenv("TIDAL_HEARTBEAT_S", "0.1")
    # 20 ms per step so a cancel lands mid-request.
    args = instance_main.parse_args(
        [
            "--nats-url",
            nats_url,
            "--id",
            "inst-t",
            "--sim-step-model",
            "linear:0.02,0,0,0",
            "--max-model-len",
            "256",
            # A lone instance: a policy that prefills and decodes where the request landed.
            "--policy",
            "aggregated",
            "--roles",
            "aggregated",
            "--tokenizer",
            "bytes",
        ]
    )
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(args, stop))
    nc = await connect(nats_url, "test")
    await _heartbeat_load(nc)  # the first heartbeat comes after the subscriptions
    try:
        yield nc
    finally:
        stop.set()
        await task
        await nc.drain()


def make_req(req_id: str, max_tokens: int = 5, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        req_id=req_id,
        model="tidal-sim",
        sampling=SamplingSpec(max_tokens=max_tokens),
        reply_subject=GW,
        messages=[ChatMessage("user", "hello")],
        **kw,
    )  # type: ignore[arg-type]


async def submit(nc: NATS, req: GenerateRequest) -> GenerateAck:
    reply = await nc.request(subjects.instance_submit("inst-t"), codec.encode(req), timeout=2)
    return codec.decode(reply.data, GenerateAck)


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
    status = await _heartbeat_load(instance)
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


async def _heartbeat_load(nc: NATS) -> dict:
    from tidal.schemas.messages import Heartbeat

    fut: asyncio.Future[Heartbeat] = asyncio.get_running_loop().create_future()

    async def on_hb(msg) -> None:  # type: ignore[no-untyped-def]
        if not fut.done():
            fut.set_result(codec.decode(msg.data, Heartbeat))

    sub = await nc.subscribe(subjects.heartbeat("instance", "inst-t"), cb=on_hb)
    hb = await asyncio.wait_for(fut, 10)
    await sub.unsubscribe()
    assert hb.load is not None
    return json.loads(codec.encode_json(hb.load))


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


async def test_an_online_first_token_is_reported_at_once(
    instance: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler places a request's decode (push migration) when a report shows it
    decoding: the report after its first token is not held back by the rate limit."""
    monkeypatch.setattr(worker, "REPORT_MIN_INTERVAL_S", 30.0)  # no report but the forced ones
    seen: list[tuple[int, int]] = []  # (output tokens of r1 in a report, tokens streamed then)
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def on_state(msg: Msg) -> None:
        for r in codec.decode(msg.data, InstanceReport).requests:
            if r.req_id == "r1":
                seen.append((r.num_output_tokens, len(chunks)))

    async def on_chunk(msg: Msg) -> None:
        chunks.append(codec.decode(msg.data, TokenChunk))
        if chunks[-1].finish_reason:
            done.set()

    await instance.subscribe(subjects.instance_state("inst-t"), cb=on_state)
    await instance.subscribe(GW, cb=on_chunk)
    assert (await submit(instance, make_req("r1", max_tokens=40))).ok
    await asyncio.wait_for(done.wait(), 30)
    assert len(chunks) == 40
    # a report showed it decoding, long before its last token
    assert any(1 <= n < 40 and streamed < 40 for n, streamed in seen), seen


async def test_an_offline_first_token_is_reported_at_once(
    instance: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline request's first token is reported at once too: `online-priority` hands the
    next held offline request to an idle prefill instance only when a report shows this one
    decoding (the 50 ms rate limit held it back: the prefill instance idled meanwhile)."""
    monkeypatch.setattr(worker, "REPORT_MIN_INTERVAL_S", 30.0)  # no report but the forced ones
    seen: list[int] = []  # output tokens of r1 in each report that lists it
    done = asyncio.Event()

    async def on_state(msg: Msg) -> None:
        seen.extend(
            r.num_output_tokens
            for r in codec.decode(msg.data, InstanceReport).requests
            if r.req_id == "r1"
        )

    async def on_chunk(msg: Msg) -> None:
        if codec.decode(msg.data, TokenChunk).finish_reason:
            done.set()

    await instance.subscribe(subjects.instance_state("inst-t"), cb=on_state)
    await instance.subscribe(GW, cb=on_chunk)
    assert (await submit(instance, make_req("r1", max_tokens=40, req_class="offline"))).ok
    await asyncio.wait_for(done.wait(), 30)
    assert any(1 <= n < 40 for n in seen), seen  # a report showed it decoding, before its end
