"""An instance's inbound requests: a submit from a gateway is checked, tokenised off the loop and
queued for the engine's next step boundary; a resend of one taken lately (its ack was lost in a
cut link) is acked again and never run twice; a cancel is queued the same way. Mixed into
`worker.Instance`, which owns the state below."""

from __future__ import annotations

import asyncio
import time

from nats.aio.msg import Msg

from services.common.bus import respond
from services.instance.chunks import Stream
from services.instance.intake import to_engine_request
from services.instance.overlap import Boundary
from services.instance.policy_adapter import PolicyAdapter, ReqMeta
from tidal.engine.api import ControllableEngine, EngineRequest, RequestClass
from tidal.policy.state import Slo
from tidal.schemas import subjects
from tidal.schemas.messages import CancelRequest, GenerateAck, GenerateRequest

RESEND_KEEP_S = 120.0  # a gateway resends a submit within ~60 s (services/common/client/bus.py)


class Inbound:
    engine: ControllableEngine
    adapter: PolicyAdapter
    default_slo: Slo
    draining: bool
    streams: dict[str, Stream]  # req_id -> where its tokens go
    # req_id -> (its gateway subject, monotonic time) of each request taken lately
    accepted: dict[str, tuple[str, float]]
    pending_add: list[EngineRequest]  # handed to the engine between steps
    pending_abort: list[str]
    boundary: Boundary
    wake: asyncio.Event

    def cut_offline_step(self, why: str) -> bool:
        raise NotImplementedError

    async def on_submit(self, req: GenerateRequest, msg: Msg) -> None:
        if self.draining:
            await respond(msg, GenerateAck(ok=False, error_code="draining", message="draining"))
            return
        if not req.reply_subject.startswith(subjects.PREFIX + ".gw."):
            ack = GenerateAck(
                ok=False,
                error_code="invalid_request",
                message="reply_subject must be a gateway subject",
            )
            await respond(msg, ack)
            return
        try:
            # off the loop: templating and tokenising a 100k-token prompt takes a while
            engine_req = await asyncio.to_thread(to_engine_request, self.engine, req)
        except ValueError as exc:
            code = "context_length_exceeded" if "context" in str(exc) else "invalid_request"
            await respond(msg, GenerateAck(ok=False, error_code=code, message=str(exc)))
            return
        now = time.monotonic()
        while self.accepted:  # oldest first (insertion order): drop those past keeping
            rid, (_, at) = next(iter(self.accepted.items()))
            if now - at <= RESEND_KEEP_S:
                break
            del self.accepted[rid]
        same = self.streams.get(req.req_id)  # checked after the await: no second copy slips in
        seen = self.accepted.get(req.req_id)
        if same is None and seen is not None and seen[0] == req.reply_subject:
            # the same gateway sending again a request that already finished or moved on from
            # here (its first ack was lost): running it again would stream it twice
            await respond(msg, self._ack(engine_req, req))
            return
        if same is not None:
            if same.reply_subject == req.reply_subject:
                # the same gateway sending it again (its first ack was lost in a cut link):
                # it runs here already, once; say so as the first time
                await respond(msg, self._ack(engine_req, req))
                return
            # not the client's fault: another gateway raced the request still running here
            ack = GenerateAck(ok=False, error_code="duplicate", message="already running here")
            await respond(msg, ack)
            return
        self.streams[req.req_id] = Stream(
            req.reply_subject, req.first_seq, num_prev_output=len(req.resume_token_ids)
        )
        self.accepted[req.req_id] = (req.reply_subject, now)
        slo = None
        if engine_req.req_class is RequestClass.ONLINE:
            slo = self.default_slo.of_request(req.ttft_slo_ms, req.tpot_slo_ms)
        self.adapter.meta[req.req_id] = ReqMeta(slo, req.arrival_unix_s or time.time())
        self.pending_add.append(engine_req)
        self.boundary.ask()
        self.wake.set()
        self.engine.wake_step()  # an engine that waits inside its step (sglang) admits it now
        if engine_req.req_class is RequestClass.ONLINE:
            self.cut_offline_step(f"online {req.req_id} arrived")
        await respond(msg, self._ack(engine_req, req))

    def _ack(self, engine_req: EngineRequest, req: GenerateRequest) -> GenerateAck:
        return GenerateAck(
            ok=True,
            num_prompt_tokens=len(engine_req.prompt_token_ids) - len(req.resume_token_ids),
            engine=self.engine.name,
            is_emulated=self.engine.is_emulated,
        )

    async def on_cancel(self, req: CancelRequest, msg: Msg) -> None:
        # NOTE: also when it has no stream here (aborting an unknown id is a no-op): a copy the
        # engine still held without one (a cut link's race) ran on, streaming to no one,
        # beside its re-run on another instance
        self.pending_abort.append(req.req_id)
        self.boundary.ask()
        self.wake.set()
