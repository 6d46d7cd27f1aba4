"""The SGLang engine's request bookkeeping: the requests it holds, each one's submission to
SGLang and what that submission's stream brings back.

A request waits here until it is submitted; a submission sends prompt + the ids generated so far
as input (so a resubmission is a recompute) under a fresh SGLang rid, and stopping it aborts that
rid in SGLang. The chunks the streams bring are matched to their request by rid (a chunk of an
aborted submission is dropped), detokenised and cut at stop strings here, and turned into
`TokenEvent`s; a submission SGLang drops by itself is requeued with its tokens, a few times.
`engine.SglangEngine` drives this from its steps and its ControllableEngine calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.instance.sglang.api import generate_body, new_rid, parse_chunk
from services.instance.sglang.client import SglangClient
from tidal.engine.api import EngineRequest, FinishReason, TokenEvent
from tidal.engine.detokenizer import Detokenizer

log = logging.getLogger("tidal.instance.sglang")

MAX_SGLANG_ABORTS = 3  # aborts by SGLang itself (not asked) requeued before the request fails


@dataclass
class SglangReq:
    """A request held here and its current submission to SGLang, if any."""

    req: EngineRequest
    detok: Detokenizer
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rid: str = ""  # the submission in SGLang now; "" while waiting here
    seen: int = 0  # tokens of the current submission already taken
    retractions: int = 0  # SGLang's priority retractions of the current submission seen
    num_sglang_aborts: int = 0

    @property
    def remaining(self) -> int:
        return self.req.sampling.max_tokens - len(self.output_ids)


class SglangStreams:
    """The requests held for SGLang and their submissions' streams; `SglangEngine`'s base."""

    def __init__(self, client: SglangClient) -> None:
        self.client = client
        self.reqs: dict[str, SglangReq] = {}  # arrival order
        self.by_rid: dict[str, str] = {}  # live rid -> req_id
        self.num_recomputes = 0  # preemptions and migrations by abort + resubmit
        self.num_sglang_retractions = 0  # SGLang's own preemptions (meta_info.num_retractions)

    def _submit(self, r: SglangReq) -> int:
        """Send `r` to SGLang with what it generated so far as input (a recompute)."""
        ids = [*r.req.prompt_token_ids, *r.output_ids]
        r.rid, r.seen, r.retractions = new_rid(), 0, 0
        self.by_rid[r.rid] = r.req.req_id
        body = generate_body(r.rid, ids, r.req.sampling, r.remaining, r.req.req_class)
        self.client.submit(r.req.req_id, r.rid, body)
        return len(ids)

    def _stop_submission(self, r: SglangReq) -> None:
        if r.rid:
            self.by_rid.pop(r.rid, None)
            self.client.abort(r.rid)
            r.rid, r.seen = "", 0

    def _drain(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        while True:
            try:
                msg = self.client.inbox.get_nowait()
            except Exception:  # queue.Empty
                return events
            req_id = self.by_rid.get(msg.rid)
            r = self.reqs.get(req_id) if req_id is not None else None
            if r is None or r.rid != msg.rid:
                continue  # a submission aborted here (preempt, migration, cancel)
            ev = self._on_msg(r, msg.obj)
            if ev is not None:
                events.append(ev)

    def _on_msg(self, r: SglangReq, obj: dict | None) -> TokenEvent | None:
        if obj is None:  # the stream ended without a finish reason
            return self._sglang_abort(r, "SGLang closed the stream")
        try:
            up = parse_chunk(obj, r.seen)
        except ValueError as exc:
            log.warning("dropped a chunk for %s: %s", r.req.req_id, exc)
            return None
        r.seen = up.completion_tokens
        if up.num_retractions > r.retractions:  # SGLang's scheduler preempted it (priority)
            self.num_sglang_retractions += up.num_retractions - r.retractions
            r.retractions = up.num_retractions
        new = list(up.token_ids[: max(0, r.remaining)])
        r.output_ids.extend(new)
        r.logprobs.extend(up.logprobs[: len(new)])
        finish = up.finish
        if finish is FinishReason.ABORT:
            return self._sglang_abort(r, up.error, new)
        if finish is None and r.remaining <= 0:
            finish = FinishReason.LENGTH
        final = finish is not None
        # as the torch engine: the EOS / stop token that ended it is output, but not text
        ends = up.stop_token is not None and r.output_ids[-1:] == [up.stop_token]
        text, hit_stop = r.detok.update(r.output_ids[:-1] if ends else r.output_ids, final)
        if hit_stop:
            finish = FinishReason.STOP
        # SGLang still runs it only when Tidal ended it (a stop string, max_tokens)
        still_runs = up.finish is None
        error = up.error if finish is FinishReason.ERROR else ""
        return self._event(r, new, text, finish, error, abort=still_runs)

    def _sglang_abort(
        self, r: SglangReq, why: str, new: list[int] | None = None
    ) -> TokenEvent | None:
        """SGLang dropped a submission it was not asked to (its own priority abort when the
        queue is full, a restart): requeue it here keeping its tokens, a few times."""
        self.by_rid.pop(r.rid, None)
        r.rid, r.seen = "", 0
        r.num_sglang_aborts += 1
        if r.num_sglang_aborts <= MAX_SGLANG_ABORTS:
            log.warning("%s: %s; requeued with its %d tokens", r.req.req_id, why, len(r.output_ids))
            self.num_recomputes += 1
            if not new:
                return None
            text, _ = r.detok.update(r.output_ids, False)
            return self._event(r, new, text, None)
        text, _ = r.detok.update(r.output_ids, True)
        return self._event(r, new or [], text, FinishReason.ERROR, why or "SGLang aborted it")

    def _event(
        self,
        r: SglangReq,
        new: list[int],
        text: str,
        finish: FinishReason | None,
        error: str = "",
        abort: bool = True,
    ) -> TokenEvent:
        if finish is not None:
            self.reqs.pop(r.req.req_id, None)
            if abort:
                self._stop_submission(r)
            else:  # SGLang ended it itself: forget the rid, nothing to abort
                self.by_rid.pop(r.rid, None)
                r.rid = ""
        lps = tuple(r.logprobs[len(r.logprobs) - len(new) :]) if r.req.sampling.logprobs else ()
        return TokenEvent(
            r.req.req_id,
            tuple(new),
            text,
            finish,
            num_prompt_tokens=len(r.req.prompt_token_ids),
            num_output_tokens=len(r.output_ids),
            logprobs=lps if len(lps) == len(new) else (),
            error=error,
        )

    def _used(self) -> int:
        return sum(
            len(r.req.prompt_token_ids) + len(r.output_ids) for r in self.reqs.values() if r.rid
        )

    def _get(self, req_id: str) -> SglangReq:
        r = self.reqs.get(req_id)
        if r is None:
            raise ValueError(f"unknown request {req_id}")
        return r
