"""An instance worker: hosts one engine, takes requests over NATS, streams tokens back.

python -m services.instance --id instance-0 --role relaxed --engine sim
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import connect, respond, subscribe
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import run_service
from services.instance.engines import ENGINES, build_engine
from tidal import envs
from tidal.engine.api import (
    Engine,
    EngineRequest,
    FinishReason,
    RequestClass,
    SamplingParams,
    TokenEvent,
)
from tidal.schemas import codec, subjects
from tidal.schemas.messages import (
    CancelRequest,
    GenerateAck,
    GenerateRequest,
    Heartbeat,
    InstanceLoad,
    TokenChunk,
)

log = logging.getLogger("tidal.instance")
ROLES = ("aggregated", "relaxed", "strict", "prefill", "decode", "p-heavy", "d-heavy")


@dataclass
class _Stream:
    reply_subject: str
    seq: int = 0


class Instance:
    def __init__(self, nc: NATS, args: argparse.Namespace, engine: Engine) -> None:
        self.nc = nc
        self.id = args.id
        self.role = args.role
        self.engine = engine
        self.streams: dict[str, _Stream] = {}  # req_id -> where its tokens go
        self.pending_add: list[EngineRequest] = []  # handed to the engine between steps
        self.pending_abort: list[str] = []
        self.wake = asyncio.Event()
        self.draining = False
        self.started_unix_s = time.time()
        self.num_steps = 0
        self.last_step_ms = 0.0

    # ---- inbound ----

    async def on_submit(self, req: GenerateRequest, msg: Msg) -> None:
        if self.draining:
            await respond(msg, GenerateAck(ok=False, error_code="draining", message="draining"))
            return
        if not req.reply_subject.startswith(subjects.PREFIX + ".gw."):
            await respond(
                msg,
                GenerateAck(
                    ok=False,
                    error_code="invalid_request",
                    message="reply_subject must be a gateway subject",
                ),
            )
            return
        try:
            engine_req = self._to_engine_request(req)
        except ValueError as exc:
            code = "context_length_exceeded" if "context" in str(exc) else "invalid_request"
            await respond(msg, GenerateAck(ok=False, error_code=code, message=str(exc)))
            return
        self.streams[req.req_id] = _Stream(req.reply_subject)
        self.pending_add.append(engine_req)
        self.wake.set()
        ack = GenerateAck(
            ok=True,
            num_prompt_tokens=len(engine_req.prompt_token_ids),
            engine=self.engine.name,
            is_emulated=self.engine.is_emulated,
        )
        await respond(msg, ack)

    def _to_engine_request(self, req: GenerateRequest) -> EngineRequest:
        tok = self.engine.tokenizer
        if req.messages is not None:
            prompt = tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in req.messages]
            )
        else:
            prompt = req.prompt or ""
        ids = tok.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        s = req.sampling
        max_tokens = s.max_tokens
        if s.max_tokens_is_default:
            max_tokens = max(1, min(max_tokens, self.engine.max_model_len - len(ids)))
        if len(ids) + max_tokens > self.engine.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context length of {self.engine.max_model_len} tokens"
            )
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
        )
        return EngineRequest(
            req_id=req.req_id,
            prompt_token_ids=ids,
            sampling=sampling,
            req_class=RequestClass(req.req_class),
            arrival_s=time.monotonic(),
        )

    async def on_cancel(self, req: CancelRequest, msg: Msg) -> None:
        if req.req_id in self.streams:
            self.pending_abort.append(req.req_id)
            self.wake.set()

    # ---- the engine loop ----

    def _apply_pending(self) -> list[TokenEvent]:
        failed: list[TokenEvent] = []
        adds, self.pending_add = self.pending_add, []
        for req in adds:
            try:
                self.engine.add(req)
            except ValueError as exc:
                failed.append(TokenEvent(req.req_id, (), "", FinishReason.ERROR, error=str(exc)))
        aborts, self.pending_abort = self.pending_abort, []
        for req_id in aborts:
            self.engine.abort(req_id)
            self.streams.pop(req_id, None)  # a cancelled client wants nothing more
        return failed

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._publish(self._apply_pending())
            if not self.engine.has_work():
                self.wake.clear()
                waiter = asyncio.ensure_future(self.wake.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                continue
            if self.engine.is_emulated:
                result = self.engine.step()
                await asyncio.sleep(result.telemetry.step_s)  # emulated step time
            else:
                result = await asyncio.to_thread(self.engine.step)
            self.num_steps += 1
            self.last_step_ms = result.telemetry.step_s * 1e3
            await self._publish(result.events)

    async def _publish(self, events: list[TokenEvent]) -> None:
        for ev in events:
            stream = self.streams.get(ev.req_id)
            if stream is None:
                continue
            chunk = TokenChunk(
                req_id=ev.req_id,
                seq=stream.seq,
                text=ev.text,
                num_tokens=len(ev.token_ids),
                num_prompt_tokens=ev.num_prompt_tokens,
                num_output_tokens=ev.num_output_tokens,
                instance_id=self.id,
                finish_reason=None if ev.finish_reason is None else str(ev.finish_reason),
                logprobs=list(ev.logprobs),
                is_emulated=self.engine.is_emulated,
                error=ev.error,
            )
            stream.seq += 1
            if ev.finish_reason is not None:
                del self.streams[ev.req_id]
            await self.nc.publish(stream.reply_subject, codec.encode(chunk))

    async def drain(self, timeout_s: float) -> None:
        """Take no new work; let running requests finish for `timeout_s`, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        stop = asyncio.Event()
        runner = asyncio.create_task(self.run(stop))
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        self.wake.set()
        await runner
        for req_id in list(self.streams):
            self.engine.abort(req_id)
            ev = TokenEvent(req_id, (), "", FinishReason.ABORT, error="instance shutting down")
            await self._publish([ev])

    def heartbeat(self, status: str = "") -> Heartbeat:
        load = self.engine.load()
        return Heartbeat(
            service_id=self.id,
            kind="instance",
            pid=os.getpid(),
            started_unix_s=self.started_unix_s,
            sent_unix_s=time.time(),
            status=status or ("draining" if self.draining else "ok"),
            role=self.role,
            engine=self.engine.name,
            model=self.engine.model_name,
            is_emulated=self.engine.is_emulated,
            load=InstanceLoad(
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                num_kv_blocks_used=load.num_kv_blocks_used,
                num_kv_blocks_total=load.num_kv_blocks_total,
                num_online=load.num_online,
                num_offline=load.num_offline,
                num_steps=self.num_steps,
                last_step_ms=round(self.last_step_ms, 3),
            ),
        )


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    subjects.check_token(args.id, "instance id")
    if args.role not in ROLES:
        raise ValueError(f"--role {args.role!r} is not one of {', '.join(ROLES)}")
    engine = await asyncio.to_thread(build_engine, args)  # loading weights can take seconds
    nc = await connect(args.nats_url, f"instance-{args.id}", args.connect_timeout_s)
    inst = Instance(nc, args, engine)
    hb_s = envs.heartbeat_s()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(nc.drain)
        await subscribe(nc, subjects.instance_submit(args.id), GenerateRequest, inst.on_submit)
        await subscribe(nc, subjects.CANCEL, CancelRequest, inst.on_cancel)
        label = " (emulated timings)" if engine.is_emulated else ""
        log.info(
            "instance %s (%s, %s engine%s, model %s) ready",
            args.id,
            args.role,
            engine.name,
            label,
            engine.model_name,
        )
        hb_stop = asyncio.Event()
        beats = asyncio.create_task(heartbeat_loop(nc, inst.heartbeat, hb_stop, hb_s))
        await inst.run(stop)
        log.info("instance %s draining", args.id)
        await inst.drain(args.drain_timeout_s)
        hb_stop.set()
        await beats
        await nc.publish(
            subjects.heartbeat("instance", args.id), codec.encode(inst.heartbeat(status="stopped"))
        )
    log.info("instance %s stopped", args.id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.instance", description=__doc__)
    p.add_argument("--nats-url", default=envs.NATS_URL.get(), help="NATS server to join")
    p.add_argument("--id", default="instance-0", help="instance id (letters, digits, _ -)")
    p.add_argument("--role", default="aggregated", help=f"one of {', '.join(ROLES)}")
    p.add_argument("--engine", default="sim", choices=ENGINES, help="engine to host")
    p.add_argument("--model", default="", help="model path (torch) or served name (sim)")
    p.add_argument("--device", default="cpu", help="torch device (torch engine)")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: model's)")
    p.add_argument(
        "--sim-step-model",
        default="linear",
        help="sim engine latency: zero | linear[:B,P,D,C] | MODEL@HARDWARE",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=5.0,
        help="on SIGTERM, let running requests finish this long before aborting",
    )
    p.add_argument("--connect-timeout-s", type=float, default=10.0, help="give up after this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("instance", lambda stop: serve(args, stop))
