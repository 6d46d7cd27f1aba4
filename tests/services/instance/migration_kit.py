"""Two live instances over a real nats-server, on the sim engine or the torch engine (the tiny
random Llama, fp32): what the migration tests share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import connect
from services.instance import main as instance_main
from tidal.schemas import codec, subjects
from tidal.schemas.kv_wire import Hello
from tidal.schemas.messages import (
    GenerateAck,
    GenerateRequest,
    InstanceReport,
    MigrateCommand,
    MigrateResult,
    SamplingSpec,
    TokenChunk,
)

GW = subjects.gateway_tokens("gw-mig")


@dataclass(frozen=True)
class EngineKind:
    """An engine the instances host, and a request long enough to migrate mid-decode."""

    name: str  # "sim" | "torch"
    args: tuple[str, ...]
    num_tokens: int


def sim_kind() -> EngineKind:
    # 20 ms emulated steps: 40 tokens take ~0.8 s, time enough to migrate mid-decode.
    return EngineKind("sim", ("--sim-step-model", "linear:0.02,0,0,0", "--tokenizer", "bytes"), 40)


def torch_kind(model_dir: str) -> EngineKind:
    # A tiny model's step takes a few ms: 300 tokens give the handshake time to happen mid-decode.
    args = ("--engine", "torch", "--model", model_dir, "--kv-cache-tokens", "4096")
    return EngineKind("torch", (*args, "--num-threads", "1"), 300)


def instance_args(nats_url: str, iid: str, index: int, kind: EngineKind) -> list[str]:
    return [
        *("--nats-url", nats_url, "--id", iid, "--index", str(index)),
        *("--policy", "aggregated", "--roles", "aggregated,aggregated"),
        *kind.args,
    ]


@contextlib.asynccontextmanager
async def running(nats_url: str, iid: str, index: int, kind: EngineKind) -> AsyncIterator[None]:
    stop = asyncio.Event()
    args = instance_main.parse_args(instance_args(nats_url, iid, index, kind))
    task = asyncio.create_task(instance_main.serve(args, stop))
    try:
        yield
    finally:
        stop.set()
        await task


@dataclass
class Gateway:
    """What a gateway subject receives."""

    chunks: list[TokenChunk] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_chunk(self, msg: Msg) -> None:
        chunk = codec.decode(msg.data, TokenChunk)
        self.chunks.append(chunk)
        if chunk.finish_reason:
            self.done.set()

    @property
    def tokens(self) -> list[TokenChunk]:
        return [c for c in self.chunks if not c.moved_to]

    def assert_complete_once(self, num_tokens: int) -> None:
        seqs = [c.seq for c in self.tokens]
        assert seqs == list(range(num_tokens)), seqs  # each seq once, in order, none missing
        assert self.tokens[-1].finish_reason == "length"
        assert self.tokens[-1].num_output_tokens == num_tokens


async def wait_report(nc: NATS, iid: str, ok: object = None, timeout_s: float = 30) -> None:
    """Wait for a state report from `iid` (one `ok(report)` accepts, when given)."""
    seen = asyncio.Event()

    async def on_state(msg: Msg) -> None:
        rep = codec.decode(msg.data, InstanceReport)
        if ok is None or ok(rep):  # type: ignore[operator]
            seen.set()

    sub = await nc.subscribe(subjects.instance_state(iid), cb=on_state)
    try:
        await asyncio.wait_for(seen.wait(), timeout_s)
    finally:
        await sub.unsubscribe()


async def start_request(
    nc: NATS, iid: str, gw: Gateway, kind: EngineKind, req_id: str = "r1", subject: str = GW
) -> None:
    await nc.subscribe(subject, cb=gw.on_chunk)
    req = GenerateRequest(
        req_id=req_id,
        model="tidal-sim",
        sampling=SamplingSpec(max_tokens=kind.num_tokens, temperature=0.0, ignore_eos=True),
        reply_subject=subject,
        prompt="migrate me over the sea",
    )
    reply = await nc.request(subjects.instance_submit(iid), codec.encode(req), timeout=10)
    assert codec.decode(reply.data, GenerateAck).ok
    while len(gw.tokens) < 5:  # decoding now
        await asyncio.sleep(0.01)


async def migrate(nc: NATS, src: str, dst: str, req_id: str = "r1") -> MigrateResult:
    cmd = MigrateCommand(req_id=req_id, dst_instance_id=dst, kind="pull")
    reply = await nc.request(subjects.instance_migrate(src), codec.encode(cmd), timeout=30)
    return codec.decode(reply.data, MigrateResult)


async def reference_text(nats_url: str, kind: EngineKind) -> str:
    """The same request served by one instance that never migrates it."""
    return await served_text(nats_url, running(nats_url, "ref", 0, kind), kind)


async def served_text(
    nats_url: str, instance: contextlib.AbstractAsyncContextManager[None], kind: EngineKind
) -> str:
    """The request served start to end by `instance`, an instance with id "ref" while open."""
    async with instance:
        nc = await connect(nats_url, "ref-client")
        await wait_report(nc, "ref")
        gw = Gateway()
        await start_request(nc, "ref", gw, kind, req_id="ref-r")
        await asyncio.wait_for(gw.done.wait(), 60)
        await nc.drain()
    return "".join(c.text for c in gw.tokens)


@dataclass
class CountingSink:
    req_id: str
    num_tokens: int
    bytes_per_token: int
    num_bytes: int = 0

    def write(self, start: int, data: bytes | bytearray | memoryview) -> None:
        self.num_bytes += len(data)


@dataclass
class CountingReceiver:
    """A data-plane `Receiver` of a target that keeps nothing: what arrived, per ticket."""

    received: dict[str, int] = field(default_factory=dict)  # ticket -> KV bytes, when complete
    states: list[bytes] = field(default_factory=list)

    def open_transfer(self, hello: Hello, state: bytes) -> CountingSink:
        self.states.append(state)
        self._sink = CountingSink(hello.ticket, hello.num_tokens, hello.bytes_per_token)
        return self._sink

    def end_transfer(self, ticket: str, error: str) -> None:
        if not error:
            self.received[ticket] = self._sink.num_bytes
