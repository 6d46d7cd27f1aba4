"""Recompute migration between two `--engine sglang` instances over a real nats-server, each
instance attached to its own fake SGLang server (`fake_sglang`: a test of the adapter, not of
SGLang). The source aborts the request in its SGLang; the target resubmits prompt + generated
ids to its own; the gateway subject gets each `seq` once and the text of a run that never
moved."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from services.common.bus import connect
from services.instance import main as instance_main
from tests.services.instance.migration_kit import (
    EngineKind,
    Gateway,
    migrate,
    served_text,
    start_request,
    wait_report,
)
from tests.services.instance.sglang.fake_sglang import FakeSglang, FakeTransfer
from tidal.engine.tokenizer import embedded_model_path

pytestmark = pytest.mark.nats
KIND = EngineKind("sglang", (), 40)  # `running` below passes the engine's options


@contextlib.asynccontextmanager
async def running(
    nats_url: str, iid: str, index: int, sglang_url: str, decode_url: str = ""
) -> AsyncIterator[None]:
    argv = [
        *(("--sglang-decode-url", decode_url) if decode_url else ()),
        *("--nats-url", nats_url, "--id", iid, "--index", str(index)),
        *("--policy", "aggregated", "--roles", "aggregated,aggregated"),
        *("--engine", "sglang", "--sglang-url", sglang_url),
        # the tokenizer comes from the model: the embedded SmolLM2's GGUF
        *("--model", str(embedded_model_path()), "--sglang-start-timeout-s", "30"),
    ]
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(instance_main.parse_args(argv), stop))
    try:
        yield
    finally:
        stop.set()
        await task


async def unmoved_text(nats_url: str) -> str:
    """The text of the request on one instance over its own fake SGLang, never moved."""
    ref = FakeSglang(token_s=0.08)
    with ref.serve():
        return await served_text(nats_url, running(nats_url, "ref", 0, ref.url), KIND)


async def test_a_migration_on_sglang_is_a_recompute_with_the_same_output(nats_url: str) -> None:
    a, b = (FakeSglang(token_s=0.08) for _ in range(2))
    want = await unmoved_text(nats_url)
    with a.serve(), b.serve():
        async with running(nats_url, "src", 0, a.url), running(nats_url, "dst", 1, b.url):
            nc = await connect(nats_url, "client")
            await wait_report(nc, "src")
            await wait_report(nc, "dst")
            gw = Gateway()
            await start_request(nc, "src", gw, KIND)
            res = await migrate(nc, "src", "dst")
            assert res.outcome == "ok", res
            assert res.mode == "recompute"
            await asyncio.wait_for(gw.done.wait(), 60)
            gw.assert_complete_once(KIND.num_tokens)
            moved = [c for c in gw.chunks if c.moved_to]
            assert [c.moved_to for c in moved] == ["dst"]
            assert "".join(c.text for c in gw.tokens) == want
            # the source's SGLang was told to stop it; the target's got prompt + generated ids
            for _ in range(600):  # the abort is posted on the source client's own loop
                if a.aborts:
                    break
                await asyncio.sleep(0.05)
            assert a.aborts == [a.bodies[0]["rid"]]
            (resumed,) = b.bodies
            n_before = len(resumed["input_ids"]) - len(a.bodies[0]["input_ids"])
            assert n_before >= 5
            assert resumed["input_ids"][: len(a.bodies[0]["input_ids"])] == a.bodies[0]["input_ids"]
            assert resumed["sampling_params"]["max_new_tokens"] == 40 - n_before
            await nc.drain()


async def test_a_migration_out_of_a_pd_pair_is_a_recompute_at_the_target(nats_url: str) -> None:
    """The source instance drives a fake prefill/decode pair (`--sglang-decode-url`); Tidal's
    migrate command still aborts at both and the target recomputes, keeping the output."""
    want = await unmoved_text(nats_url)
    transfer = FakeTransfer()
    pre = FakeSglang(token_s=0.08, mode="prefill", transfer=transfer)
    dec = FakeSglang(token_s=0.08, mode="decode", transfer=transfer)
    b = FakeSglang(token_s=0.08)
    with pre.serve(), dec.serve(), b.serve():
        async with (
            running(nats_url, "src", 0, pre.url, dec.url),
            running(nats_url, "dst", 1, b.url),
        ):
            nc = await connect(nats_url, "client")
            await wait_report(nc, "src")
            await wait_report(nc, "dst")
            gw = Gateway()
            await start_request(nc, "src", gw, KIND)
            res = await migrate(nc, "src", "dst")
            assert res.outcome == "ok" and res.mode == "recompute", res
            await asyncio.wait_for(gw.done.wait(), 60)
            gw.assert_complete_once(KIND.num_tokens)
            assert "".join(c.text for c in gw.tokens) == want
            rid = dec.bodies[0]["rid"]
            assert pre.bodies[0]["rid"] == rid and dec.bodies[0]["bootstrap_room"] is not None
            for _ in range(600):
                if dec.aborts and pre.aborts:
                    break
                await asyncio.sleep(0.05)
            assert dec.aborts == [rid] and pre.aborts == [rid]
            await nc.drain()
