"""An instance's state reports (`services.instance.report`): held to at most one every
REPORT_MIN_INTERVAL_S, except the one after a request's first token."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.instance import report
from tests.services.instance.instance_kit import GW, make_req, serve_instance, submit
from tidal.schemas import codec, subjects
from tidal.schemas.messages import InstanceReport, TokenChunk

pytestmark = pytest.mark.nats


async def test_an_online_first_token_is_reported_at_once(
    instance: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler places a request's decode (push migration) when a report shows it
    decoding: the report after its first token is not held back by the rate limit."""
    monkeypatch.setattr(report, "REPORT_MIN_INTERVAL_S", 30.0)  # no report but the forced ones
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
    monkeypatch.setattr(report, "REPORT_MIN_INTERVAL_S", 30.0)  # no report but the forced ones
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


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_prefill_instance_reports_a_first_token_at_once(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """`online-priority`'s prefill instance runs no decode: after an offline prefill it has
    nothing to plan until the request's KV is pushed away. The report showing the first token
    still goes out at once, with overlap too (there the step's own report went out while it
    computed, and the next came from the idle-plan path, rate-limited: the scheduler's next
    hand-out to the idle instance waited up to 50 ms a line, live 0.83 of the simulator)."""
    monkeypatch.setattr(report, "REPORT_MIN_INTERVAL_S", 30.0)  # no report but the forced ones
    seen = asyncio.Event()

    async def on_state(msg: Msg) -> None:
        for r in codec.decode(msg.data, InstanceReport).requests:
            if r.req_id == "r1" and r.num_output_tokens >= 1:
                seen.set()

    monkeypatch.setenv("TIDAL_OVERLAP", "1")
    more = ["--drain-timeout-s", "0.1", *([] if overlap else ["--no-overlap"])]
    async for nc in serve_instance(
        nats_url, monkeypatch, "online-priority", "relaxed,strict", *more
    ):
        await nc.subscribe(subjects.instance_state("inst-t"), cb=on_state)
        assert (await submit(nc, make_req("r1", max_tokens=40, req_class="offline"))).ok
        # no decode runs here (no scheduler pushes it away): only a forced report shows it
        await asyncio.wait_for(seen.wait(), 5)
