"""Overlap changes when the instance's own work happens, never what it decides: the same requests,
all handed over before the first step, give the same tokens, finish reasons and sequence of
engine steps with overlap on and off, on the sim engine and the torch engine. With overlap on,
decode-only plans the policy allows to repeat run without asking it again."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import connect
from services.common.torch_threads import ComputeThread
from services.instance import main as instance_main
from services.instance.engines import build_engine
from services.instance.worker import Instance
from tests.services.instance.migration_kit import EngineKind, instance_args
from tidal.config.live import load_live_config
from tidal.policy.base import StepPlan
from tidal.schemas import codec, subjects
from tidal.schemas.messages import ChatMessage, GenerateRequest, SamplingSpec, TokenChunk

pytestmark = pytest.mark.nats
GW = subjects.gateway_tokens("gw-overlap")
# (req_id, class, max_tokens): offline work of mixed lengths and two online requests, so that
# requests finish at different steps and batches change shape between repeats
REQUESTS = (
    ("off-0", "offline", 30),
    ("off-1", "offline", 12),
    ("on-0", "online", 20),
    ("off-2", "offline", 41),
    ("on-1", "online", 7),
    ("off-3", "offline", 25),
)


class _NoReply:
    reply = ""  # `services.common.bus.respond` sends nothing


@dataclass
class Run:
    """What one instance run gave: each request's chunks, and each step's plan."""

    chunks: dict[str, list[TokenChunk]] = field(default_factory=dict)
    steps: list[tuple[dict[str, int], tuple[str, ...]]] = field(default_factory=list)
    num_plans: int = 0  # times the policy was asked
    made: dict[str, int] = field(default_factory=dict)  # req_id -> tokens the engine made
    held: dict[str, int] = field(default_factory=dict)  # req_id -> offline tokens held back

    def tokens(self) -> dict[str, tuple[list[int], str | None]]:
        return {
            rid: ([t for c in cs for t in c.token_ids], cs[-1].finish_reason)
            for rid, cs in self.chunks.items()
        }


async def _run(nats_url: str, kind: EngineKind, overlap: bool, stop_after_steps: int = 0) -> Run:
    args = instance_main.parse_args(instance_args(nats_url, "inst-ovl", 0, kind))
    live = load_live_config(args.config, args.policy, args.roles)
    compute = ComputeThread("engine-test")
    engine = await compute.run(build_engine, args)
    adapter = instance_main.build_adapter(args, live, engine)
    out = Run()
    step = engine.step
    plan_of = adapter.plan

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def recording_step(plan: StepPlan | None = None) -> Any:
        assert plan is not None
        out.steps.append((dict(plan.prefill), tuple(plan.decode)))
        result = step(plan)
        for ev in result.events:
            out.made[ev.req_id] = out.made.get(ev.req_id, 0) + len(ev.token_ids)
        if len(out.steps) == stop_after_steps:
            loop.call_soon_threadsafe(stop.set)
        return result

    def counting_plan(now: float) -> StepPlan:
        out.num_plans += 1
        return plan_of(now)

    engine.step = recording_step  # type: ignore[method-assign]
    adapter.plan = counting_plan  # type: ignore[method-assign]
    nc: NATS = await connect(nats_url, "test-overlap")
    done = asyncio.Event()

    async def on_chunk(msg: Msg) -> None:
        chunk = codec.decode(msg.data, TokenChunk)
        out.chunks.setdefault(chunk.req_id, []).append(chunk)
        ended = sum(1 for cs in out.chunks.values() if cs[-1].finish_reason)
        if ended == len(REQUESTS):
            done.set()

    await nc.subscribe(GW, cb=on_chunk)
    inst = Instance(nc, "inst-ovl", engine, adapter, live.cfg.slo, compute, overlap=overlap)
    for rid, cls, n in REQUESTS:  # all handed over before the first step: one plan sequence
        req = GenerateRequest(
            req_id=rid,
            model="m",
            sampling=SamplingSpec(max_tokens=n, temperature=0.0),
            reply_subject=GW,
            req_class=cls,
            messages=[ChatMessage("user", f"tell me about {rid} " * 3)],
        )
        await inst.on_submit(req, _NoReply())  # type: ignore[arg-type]
    task = asyncio.create_task(inst.run(stop))
    try:
        if stop_after_steps:
            await asyncio.wait_for(stop.wait(), 120)
        else:
            await asyncio.wait_for(done.wait(), 120)
    finally:
        stop.set()
        inst.wake.set()
        await task
        out.held = {rid: st.num_held_tokens for rid, st in inst.streams.items()}
        await nc.flush()
        await asyncio.sleep(0.2)  # the last chunks reach the subscription
        await nc.drain()
        compute.close()
    return out


async def test_overlap_gives_the_same_tokens_and_steps(
    nats_url: str, engine_kind: EngineKind
) -> None:
    plain = await _run(nats_url, engine_kind, overlap=False)
    overlapped = await _run(nats_url, engine_kind, overlap=True)
    assert set(plain.chunks) == {rid for rid, _, _ in REQUESTS}
    for rid, _, n in REQUESTS:
        ids, finish = plain.tokens()[rid]
        assert finish == "length" and len(ids) == n  # every request ran to its end
    assert overlapped.tokens() == plain.tokens()
    assert overlapped.steps == plain.steps  # the same plan, step after step
    assert plain.num_plans >= len(plain.steps)  # asked before every step
    # with overlap the policy's permission to repeat decode-only plans was used
    assert overlapped.num_plans < len(overlapped.steps)
    for rid, *_ in REQUESTS:  # chunks numbered once each, in order
        assert [c.seq for c in overlapped.chunks[rid]] == list(range(len(overlapped.chunks[rid])))


async def test_a_loop_stopped_mid_stream_still_publishes_its_last_step(nats_url: str) -> None:
    """With overlap a step's tokens go out during the next step: when the loop stops after a
    step, its tokens are published on the way out, not dropped (an offline request's may still
    be held back for its next chunk, as without overlap: `drain` sends those with its end)."""
    from tests.services.instance.migration_kit import sim_kind

    got = await _run(nats_url, sim_kind(), overlap=True, stop_after_steps=1)
    assert got.made and sum(got.made.values()) > 0
    for rid, n in got.made.items():
        sent = sum(c.num_tokens for c in got.chunks.get(rid, []))
        assert sent + got.held.get(rid, 0) == n, (rid, sent, n)
    assert any(sum(c.num_tokens for c in got.chunks.get(rid, [])) for rid in got.made)


class _Published:
    """A NATS client that keeps what is published."""

    def __init__(self) -> None:
        self.chunks: list[TokenChunk] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.chunks.append(codec.decode(data, TokenChunk))


async def test_a_request_leaving_takes_its_unsent_tokens_first(nats_url: str) -> None:
    """A migration flushes the request before it moves (`Publisher.flush`): the tokens of the
    step just run, noted but not yet published (overlap sends them during the next step), go
    out then too, before the chunk that says where it went."""
    from tests.services.instance.migration_kit import sim_kind
    from tidal.engine.api import TokenEvent

    args = instance_main.parse_args(instance_args(nats_url, "inst-flush", 0, sim_kind()))
    live = load_live_config(args.config, args.policy, args.roles)
    engine = build_engine(args)
    adapter = instance_main.build_adapter(args, live, engine)
    nc = _Published()
    inst = Instance(nc, "inst-flush", engine, adapter, live.cfg.slo)  # type: ignore[arg-type]
    for rid, cls in (("a", "online"), ("b", "offline")):
        req = GenerateRequest(
            req_id=rid,
            model="m",
            sampling=SamplingSpec(max_tokens=8),
            reply_subject=GW,
            req_class=cls,
            messages=[ChatMessage("user", "hi")],
        )
        await inst.on_submit(req, _NoReply())  # type: ignore[arg-type]
    inst.unsent = [TokenEvent("a", (5, 6), "xy"), TokenEvent("b", (7,), "z")]
    await inst.flush("b")
    assert [(c.req_id, c.token_ids) for c in nc.chunks] == [("b", [7])]
    assert [ev.req_id for ev in inst.unsent] == ["a"]  # the other request's wait their turn
    await inst.flush("a")
    assert [(c.req_id, c.token_ids) for c in nc.chunks][1:] == [("a", [5, 6])]
    assert inst.unsent == []
