"""Preemption as a bus signal (`tidal.inst.<id>.preempt`, `services/instance/preempt.py`) on a
live instance over a real nats-server: offline work freed at the next step boundary by recompute,
swap or (torch, checkpoints on) release; online work only below `below_priority`; a malformed
request answered with an error; every preempted request still completes, and on the torch
engine with the same text."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS

from services.common.bus import connect
from services.instance import main as instance_main
from tests.services.instance.migration_kit import (
    EngineKind,
    Gateway,
    instance_args,
    sim_kind,
    torch_kind,
    wait_report,
)
from tidal.configs import config_path
from tidal.schemas import codec, subjects
from tidal.schemas.control import CtlPreemptReply
from tidal.schemas.messages import GenerateAck, GenerateRequest, SamplingSpec

pytestmark = pytest.mark.nats
ONE_BY_ONE = ("--offline-chunk-tokens", "1")  # an offline request's tokens out at once


class Stream(Gateway):
    """What one request's gateway subject receives."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    def assert_complete(self, num_tokens: int) -> None:
        assert [c.seq for c in self.chunks] == list(range(len(self.chunks)))  # no gap, no repeat
        assert self.chunks[-1].finish_reason == "length", self.chunks[-1]
        assert self.num_tokens == self.chunks[-1].num_output_tokens == num_tokens


@contextlib.asynccontextmanager
async def running(nats_url: str, k: EngineKind, *extra: str) -> AsyncIterator[NATS]:
    args = instance_main.parse_args([*instance_args(nats_url, "inst-p", 0, k), *extra])
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(args, stop))
    nc = await connect(nats_url, "client-p")
    try:
        await wait_report(nc, "inst-p")
        yield nc
    finally:
        stop.set()
        await task
        await nc.drain()


async def start(nc: NATS, req_id: str, num_tokens: int, req_class: str = "offline") -> Stream:
    stream = Stream()
    subject = subjects.gateway_tokens(f"gw-{req_id}")
    await nc.subscribe(subject, cb=stream.on_chunk)
    req = GenerateRequest(
        req_id=req_id,
        model="tidal-sim",
        sampling=SamplingSpec(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
        reply_subject=subject,
        req_class=req_class,
        prompt="preempt me over the sea",
    )
    reply = await nc.request(subjects.instance_submit("inst-p"), codec.encode(req), timeout=10)
    assert codec.decode(reply.data, GenerateAck).ok
    return stream


async def decoding(*streams: Stream, num_tokens: int = 5) -> None:
    async with asyncio.timeout(30):
        while any(s.num_tokens < num_tokens for s in streams):
            await asyncio.sleep(0.01)


async def preempt(nc: NATS, body: bytes) -> CtlPreemptReply:
    reply = await nc.request(subjects.instance_preempt("inst-p"), body, timeout=10)
    return msgspec.json.decode(reply.data, type=CtlPreemptReply)


async def test_offline_work_is_freed_by_the_signal_and_still_completes(nats_url: str) -> None:
    k = sim_kind()  # 20 ms steps
    n = 60
    async with running(nats_url, k, *ONE_BY_ONE) as nc:
        online = await start(nc, "on", n, req_class="online")
        a, b = await start(nc, "a", n), await start(nc, "b", n)
        await decoding(online, a, b)

        bad = [
            (b"{not json", "bad preempt request"),
            (b'{"num_block": 3}', "unknown field"),
            (b'{"req_class": "online", "num_blocks": 1}', "only offline work"),
            (b'{"req_ids": ["on"]}', "online work is never preempted"),
            (b'{"req_ids": ["a", "on"]}', "online work is never preempted"),
            (b'{"num_blocks": 100000}', "fewer than the 100000 asked for"),
            (b"{}", "name req_ids, or num_blocks >= 1"),
            (b'{"num_blocks": 1, "below_priority": "high"}', "$.below_priority"),
            (b'{"num_blocks": 1, "below_priority": 99999999999}', "below_priority must be"),
            (b'{"req_ids": ["on"], "below_priority": 0}', "priority 0, not below 0"),
        ]
        for body, why in bad:
            rep = await preempt(nc, body)
            assert why in rep.error, (body, rep)
            assert rep.preempted == [] and rep.freed_blocks == 0

        rep = await preempt(nc, b'{"num_blocks": 1}')  # the latest offline arrival: b
        assert rep.error == ""
        assert [(p.req_id, p.how) for p in rep.preempted] == [("b", "recompute")]
        assert rep.preempted[0].tokens_lost > 0 and rep.freed_blocks >= 1
        assert rep.free_ms > 0

        rep = await preempt(nc, b'{"req_ids": ["a"], "swap": true}')
        assert [(p.req_id, p.how, p.tokens_lost) for p in rep.preempted] == [("a", "swap", 0)]
        assert rep.freed_blocks >= 1

        # a higher class's signal: the online request (priority 0) is recomputed
        rep = await preempt(nc, b'{"req_ids": ["on"], "below_priority": 1}')
        assert [(p.req_id, p.how) for p in rep.preempted] == [("on", "recompute")], rep

        async with asyncio.timeout(30):
            await asyncio.gather(online.done.wait(), a.done.wait(), b.done.wait())
        for s in (online, a, b):
            s.assert_complete(n)  # nothing lost: they resumed as the policy planned


async def test_a_checkpoint_option_on_an_engine_without_them_is_refused(nats_url: str) -> None:
    args = instance_main.parse_args(
        [*instance_args(nats_url, "inst-x", 0, sim_kind()), "--checkpoint-host-gb", "1"]
    )
    with pytest.raises(ValueError, match="sim engine keeps no KV checkpoints"):
        await instance_main.serve(args, asyncio.Event())


@pytest.fixture
def fp32(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch

    monkeypatch.setenv("TIDAL_DTYPE", "float32")
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)  # the instance sets one thread for this process


def checkpoint_config(tmp_path: Path) -> Path:
    """The embedded config with checkpoint memory and `aggregated`'s `checkpoint_offline`."""
    text = config_path("embedded.yaml").read_text()
    path = tmp_path / "ckpt.yaml"
    path.write_text(
        text + "  aggregated:\n    checkpoint_offline: true\ncheckpoint_host_gb: 0.01\n"
    )
    return path


@pytest.mark.slow
@pytest.mark.usefixtures("fp32")
async def test_torch_checkpoints_live_and_a_release_loses_under_two_blocks(
    nats_url: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    k = torch_kind(str(tiny_llama_dir))
    n = 200
    cfg = ("--config", str(checkpoint_config(tmp_path)))
    async with running(nats_url, k, *cfg, *ONE_BY_ONE) as nc:
        ref = await start(nc, "ref", n)
        async with asyncio.timeout(60):
            await ref.done.wait()
        s = await start(nc, "r", n)
        await decoding(s, num_tokens=100)
        rep = await preempt(nc, b'{"req_ids": ["r"]}')
        assert rep.error == ""
        [p] = rep.preempted
        # the policy checkpointed it while it decoded (at least once a block), so its blocks go
        # at once and only the tail past its last checkpoint is computed again
        assert p.how == "release" and 0 <= p.tokens_lost < 2 * 16, p
        assert rep.freed_blocks >= 100 // 16
        async with asyncio.timeout(60):
            await s.done.wait()
        s.assert_complete(n)
        assert s.text == ref.text  # restored from the checkpoint, tail recomputed: same tokens
