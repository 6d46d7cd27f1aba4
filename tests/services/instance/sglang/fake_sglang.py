"""A small fake of the SGLang HTTP server, for unit tests of the `sglang` engine adapter alone.

It speaks the subset the adapter uses, as SGLang 0.5.23 defines it (PyPI wheel
`sglang-0.5.23-cp311`):

- `POST /generate` — `sglang/srt/entrypoints/http_server.py` `generate_request` with the body
  `GenerateReqInput` (`sglang/srt/managers/io_struct.py`); streamed as `data: {json}` lines and
  `data: [DONE]`, `output_ids` cumulative (`managers/tokenizer_manager.py`, the default without
  `--incremental-streaming-output`), `meta_info.completion_tokens` and `finish_reason`
  (`{"type": "length"}` / `{"type": "stop", "matched": id}` / `{"type": "abort"}`); unknown body
  or `sampling_params` keys get HTTP 400 (`entrypoints/api_contract.py`,
  `sampling/sampling_params.py`); `max_new_tokens` defaults to 128;
- `POST /abort_request` — `AbortReq` (`rid`, `abort_all`), rid matched by prefix;
- `GET /v1/loads` — `entrypoints/v1_loads.py` over `managers/load_snapshot.py` `LoadSnapshot`;
- `GET /server_info`, `GET /health`.

PD disaggregation (`FakeSglang(mode="prefill" | "decode", transfer=...)`), modelled on
`sglang/srt/disaggregation/{prefill,decode}.py` and `managers/scheduler.py`: in either mode a
request without `bootstrap_room` is aborted with SGLang's message and HTTP 400; a prefill server
computes the first token (it forces `max_new_tokens` to 1), puts the "KV" (the prompt and that
token) into the shared `FakeTransfer` under the room, and answers `finish_reason`
`{"type": "length", "length": 0}`; a decode server keeps a request waiting (counted in
`num_waiting_reqs`, as its prealloc/transfer queues are) until the KV of its room lands, then
streams from the prefill's first token on; one waiting longer than `waiting_timeout_s` (SGLang:
`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s) is aborted. `/server_info` reports
`disaggregation_mode` and `disaggregation_bootstrap_port`. The transfer itself is instant.

Scheduling is a crude stand-in for SGLang's: at most `max_running` requests decode, one token
each per `token_s`; the waiting ones go in by priority (larger first), then arrival. With every
slot taken, a waiting request more than `PREEMPTION_THRESHOLD` (10) above the lowest running one
retracts it (the lowest priority, the latest queued first), which keeps its tokens, waits again
and counts in its `meta_info.num_retractions`, as `managers/schedule_policy.py`
`preempt_to_schedule` and `managers/tokenizer_manager.py` do. The next
token is a fixed function of the whole context, like greedy decoding, so a recompute from
prompt + generated ids continues exactly as the uninterrupted request would. This is a test of
the adapter alone, never evidence that Tidal runs on SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.cli import natsd

PREEMPTION_THRESHOLD = 10  # --priority-scheduling-preemption-threshold's default
BODY_KEYS = {"rid", "input_ids", "text", "sampling_params", "stream", "priority", "return_logprob"}
BODY_KEYS |= {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos"}
SAMPLING_KEYS |= {"stop_token_ids", "sampling_seed", "skip_special_tokens", "stop"}
VOCAB = 1000


def next_token(context: list[int]) -> int:
    """Deterministic 'greedy' next token of a context (never 0-2: no special tokens)."""
    return 3 + (sum(context[-4:]) * 31 + len(context) * 7) % (VOCAB - 3)


NO_ROOM = "Invalid request: Disaggregated request received without bootstrap room id."


class FakeTransfer:
    """The KV a fake prefill server pushed, by room; shared by the two fake servers of a pair
    (each runs its own loop in its own thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kv: dict[int, tuple[list[int], int]] = {}  # room -> (prompt, first token)

    def put(self, room: int, prompt: list[int], first: int) -> None:
        with self._lock:
            self._kv[room] = (list(prompt), first)

    def take(self, room: int) -> tuple[list[int], int] | None:
        with self._lock:
            return self._kv.pop(room, None)


@dataclass
class FakeReq:
    rid: str
    input_ids: list[int]
    max_new: int
    priority: int
    stop_ids: set[int]
    arrival: float
    out: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    room: int | None = None  # PD: the bootstrap room
    retractions: int = 0  # times priority preemption sent it back to waiting


class FakeSglang:
    def __init__(
        self,
        max_running: int = 8,
        token_s: float = 0.002,
        total_tokens: int = 20000,
        mode: str = "null",
        transfer: FakeTransfer | None = None,
        waiting_timeout_s: float = 300.0,
    ):
        assert mode in ("null", "prefill", "decode") and (mode == "null") == (transfer is None)
        self.max_running = max_running
        self.token_s = token_s
        self.total_tokens = total_tokens
        self.mode = mode
        self.transfer = transfer
        self.waiting_timeout_s = waiting_timeout_s
        self.bootstrap_port = 8998
        self.bodies: list[dict[str, Any]] = []  # every /generate body, in arrival order
        self.aborts: list[str] = []  # every /abort_request rid
        self.refuse = ""  # when set, /generate answers 400 with this message
        self.running: list[FakeReq] = []
        self.waiting: list[FakeReq] = []
        self.app = self._build()
        self.url = ""
        self._server: uvicorn.Server | None = None

    # ---- scheduling ----

    def _admit(self) -> None:
        self.waiting.sort(key=lambda r: (-r.priority, r.arrival))
        for r in list(self.waiting):
            if len(self.running) >= self.max_running and not self._retract_for(r):
                return
            if self.mode == "decode":
                assert self.transfer is not None and r.room is not None
                kv = self.transfer.take(r.room)
                if kv is None:
                    if time.monotonic() - r.arrival > self.waiting_timeout_s:
                        self.waiting.remove(r)
                        self._end(
                            r,
                            {
                                "type": "abort",
                                "message": "Timed out waiting for prefill completion",
                            },
                        )  # disaggregation/common/conn.py
                    continue  # its KV has not landed
                self.waiting.remove(r)
                self.running.append(r)
                self._emit(r, kv[1])  # the prefill's first token is the decode's first output
                continue
            self.waiting.remove(r)
            self.running.append(r)

    def _retract_for(self, r: FakeReq) -> bool:
        """Priority preemption: send the lowest running request back to waiting for `r`."""
        if self.mode != "null" or not self.running:
            return False
        victim = min(self.running, key=lambda x: (x.priority, -x.arrival))
        if r.priority - victim.priority <= PREEMPTION_THRESHOLD:
            return False
        self.running.remove(victim)
        victim.retractions += 1
        self.waiting.append(victim)
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.token_s)
            self._admit()
            for r in list(self.running):
                if r.finish is not None:
                    continue
                tok = next_token([*r.input_ids, *r.out])
                if self.mode == "prefill":  # the KV goes to the decode server, then it answers
                    assert self.transfer is not None and r.room is not None
                    self.transfer.put(r.room, r.input_ids, tok)
                    r.out.append(tok)
                    self.running.remove(r)
                    self._end(r, {"type": "length", "length": 0})
                    continue
                self._emit(r, tok)

    def _emit(self, r: FakeReq, tok: int) -> None:
        r.out.append(tok)
        if tok in r.stop_ids:
            r.finish = {"type": "stop", "matched": tok}
        elif len(r.out) >= r.max_new:
            r.finish = {"type": "length", "length": r.max_new}
        r.chunks.put_nowait(self._chunk(r))
        if r.finish is not None:
            self.running.remove(r)
            r.chunks.put_nowait(None)

    def _chunk(self, r: FakeReq) -> dict[str, Any]:
        meta = {
            "id": r.rid,
            "finish_reason": r.finish,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.out),
            "num_retractions": r.retractions,
        }
        return {"text": None, "output_ids": list(r.out), "meta_info": meta}

    def _end(self, r: FakeReq, finish: dict[str, Any]) -> None:
        r.finish = finish
        r.chunks.put_nowait(self._chunk(r))
        r.chunks.put_nowait(None)

    def _abort(self, rid: str) -> None:
        for q in (self.running, self.waiting):
            for r in [r for r in q if r.rid.startswith(rid)]:
                q.remove(r)
                r.finish = {"type": "abort", "message": "Abort in waiting queue"}
                r.chunks.put_nowait(None)

    # ---- HTTP ----

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if self.refuse:
                return JSONResponse({"error": {"message": self.refuse}}, 400)
            if bad := set(body) - BODY_KEYS:
                return JSONResponse({"error": f"unknown field(s) {sorted(bad)}"}, 400)
            sp = body.get("sampling_params") or {}
            if bad := set(sp) - SAMPLING_KEYS:
                return JSONResponse({"error": f"unknown sampling_params {sorted(bad)}"}, 400)
            r = FakeReq(
                body.get("rid") or uuid.uuid4().hex,  # SGLang makes one when omitted
                list(body["input_ids"]),
                1 if self.mode == "prefill" else int(sp.get("max_new_tokens", 128)),
                int(body.get("priority") or 0),
                set(sp.get("stop_token_ids") or ()),
                time.monotonic(),
                room=body.get("bootstrap_room"),
            )
            if self.mode != "null" and r.room is None:  # managers/scheduler.py
                msg = f"{NO_ROOM} req.rid={r.rid!r}"
                self._end(r, {"type": "abort", "message": msg, "status_code": 400})
            else:
                self.waiting.append(r)
            if body.get("stream") is False:
                return await answer(r)

            async def stream() -> AsyncIterator[bytes]:
                while (chunk := await r.chunks.get()) is not None:
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        async def answer(r: FakeReq) -> Response:
            """Not streamed: the last chunk; an abort with a status code is that HTTP error
            (`tokenizer_manager.py` `_handle_abort_finish_reason`)."""
            last = None
            while (chunk := await r.chunks.get()) is not None:
                last = chunk
            last = last or self._chunk(r)  # aborted without a chunk: its finish as it stands
            fr = last["meta_info"]["finish_reason"] or {}
            if fr.get("type") == "abort" and fr.get("status_code"):
                return JSONResponse({"error": {"message": fr["message"]}}, fr["status_code"])
            return JSONResponse(last)

        @app.post("/abort_request")
        async def abort(request: Request) -> Response:
            body = await request.json()
            self.aborts.append(body.get("rid", ""))
            self._abort(body.get("rid", ""))
            return Response(status_code=200)

        @app.get("/v1/loads")
        async def loads() -> dict[str, Any]:
            used = sum(len(r.input_ids) + len(r.out) for r in self.running)
            load = {
                "dp_rank": 0,
                "num_running_reqs": len(self.running),
                "num_waiting_reqs": len(self.waiting),
                "num_used_tokens": used,
                "max_total_num_tokens": self.total_tokens,
                "token_usage": used / self.total_tokens,
                "gen_throughput": 123.0,
            }
            return {"version": "0.5.23", "loads": [load]}

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {
                "served_model_name": "fake-model",
                "context_length": 4096,
                "version": "0.5.23",
                "disaggregation_mode": self.mode,
                "disaggregation_bootstrap_port": self.bootstrap_port,
            }

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.on_event("startup")
        async def start_loop() -> None:
            app.state.loop_task = asyncio.create_task(self._loop())

        return app

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        port = natsd.free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        thread = threading.Thread(target=self._server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake SGLang did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        try:
            yield self.url
        finally:
            self._server.should_exit = True
            thread.join(timeout=10)
