"""`tidal bench checkpoint --live`: the preempt signal on a live torch instance, with and
without KV checkpoints (issue 39 items 3 and 4).

A nats-server and one instance (torch engine, `aggregated`; with checkpoints: `--checkpoint-host-gb`
and `checkpoint_offline`) in this process. N offline requests decode `--decode` tokens, then
one `tidal.inst.<id>.preempt` names them all; the instance answers with how each went, the
tokens it lost and the time from the signal to the blocks free (`free_ms`, the wait for the
step boundary included). Then the time until every request finished (`--after` more tokens each).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.cli import natsd
from services.common.bus import connect
from services.instance import main as instance_main
from tidal.configs import config_path
from tidal.schemas import codec, subjects
from tidal.schemas.control import CtlPreemptReply
from tidal.schemas.messages import GenerateAck, GenerateRequest, SamplingSpec, TokenChunk

IID = "bench-ckpt"


@dataclass(frozen=True)
class LiveFigures:
    mode: str  # "checkpoint" | "recompute"
    how: list[str]  # per request: release | recompute
    free_ms: float  # signal -> every block free, at the instance
    boundary_ms: float  # of it, the wait for the step in flight to end
    freed_blocks: int
    tokens_lost: int  # over all requests: computed again after resuming
    finish_s: float  # signal -> every request finished


@contextlib.asynccontextmanager
async def _bus() -> AsyncIterator[str]:
    port = natsd.free_port()
    store = tempfile.mkdtemp(prefix="tidal-bench-js-")
    proc = natsd.start_nats_server(port, store)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        shutil.rmtree(store, ignore_errors=True)


def _config(dir_: Path, checkpoints: bool) -> Path:
    path = dir_ / "live-ckpt.yaml"
    extra = f"  aggregated:\n    checkpoint_offline: {str(checkpoints).lower()}\n"
    path.write_text(config_path("embedded.yaml").read_text() + extra)
    return path


async def _one(
    url: str, argv: list[str], n: int, prompt: str, decode: int, after: int
) -> tuple[CtlPreemptReply, float]:
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(instance_main.parse_args(argv), stop))
    nc = await connect(url, "bench")
    try:
        ready = asyncio.Event()

        async def on_state(_: Msg) -> None:
            ready.set()

        sub = await nc.subscribe(subjects.instance_state(IID), cb=on_state)
        async with asyncio.timeout(600):  # the model loads
            await ready.wait()
        await sub.unsubscribe()
        counts = [0] * n
        done = [asyncio.Event() for _ in range(n)]
        for i in range(n):
            await _submit(nc, i, prompt, decode + after, counts, done[i])
        async with asyncio.timeout(600):
            while min(counts) < decode:
                await asyncio.sleep(0.005)
        body = msgspec.json.encode({"req_ids": [f"r{i}" for i in range(n)]})
        t0 = time.perf_counter()
        msg = await nc.request(subjects.instance_preempt(IID), body, timeout=60)
        reply = msgspec.json.decode(msg.data, type=CtlPreemptReply)
        async with asyncio.timeout(600):
            await asyncio.gather(*(d.wait() for d in done))
        return reply, time.perf_counter() - t0
    finally:
        await nc.drain()
        stop.set()
        await task


async def _submit(
    nc: NATS, i: int, prompt: str, max_tokens: int, counts: list[int], done: asyncio.Event
) -> None:
    subject = subjects.gateway_tokens(f"bench-{i}")

    async def on_chunk(msg: Msg) -> None:
        chunk = codec.decode(msg.data, TokenChunk)
        counts[i] += chunk.num_tokens
        if chunk.finish_reason:
            done.set()

    await nc.subscribe(subject, cb=on_chunk)
    req = GenerateRequest(
        req_id=f"r{i}",
        model="bench",
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        reply_subject=subject,
        req_class="offline",
        prompt=prompt,
    )
    reply = await nc.request(subjects.instance_submit(IID), codec.encode(req), timeout=60)
    ack = codec.decode(reply.data, GenerateAck)
    if not ack.ok:
        raise SystemExit(f"the instance refused a request: {ack.message}")


async def measure(
    model: str, n: int, context: int, decode: int, after: int, threads: int, dtype: str
) -> list[LiveFigures]:
    prompt = " ".join(["tide"] * context)  # a token or a few a word
    # NOTE: the engine's default KV pool (65536 tokens) holds them all: only the signal preempts
    out: list[LiveFigures] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with _bus() as url:
            for checkpoints in (True, False):
                argv = [
                    *("--nats-url", url, "--id", IID, "--engine", "torch"),
                    *("--policy", "aggregated", "--roles", "aggregated"),
                    *("--config", str(_config(Path(tmp), checkpoints))),
                    *("--offline-chunk-tokens", "1", "--num-threads", str(threads)),
                    *("--dtype", dtype),
                    *("--checkpoint-host-gb", "2" if checkpoints else "0"),
                    *(("--model", model) if model else ()),
                ]
                reply, finish_s = await _one(url, argv, n, prompt, decode, after)
                if reply.error:  # a request ended before the signal reached it: raise --after
                    raise SystemExit(f"preempt refused: {reply.error}")
                out.append(
                    LiveFigures(
                        "checkpoint" if checkpoints else "recompute",
                        [p.how for p in reply.preempted],
                        reply.free_ms,
                        reply.boundary_ms,
                        reply.freed_blocks,
                        sum(p.tokens_lost for p in reply.preempted),
                        round(finish_s, 3),
                    )
                )
    return out
