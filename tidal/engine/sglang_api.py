"""The subset of SGLang's HTTP API the `sglang` instance backend speaks, as pure functions.

Pinned to SGLang 0.5.23 (PyPI wheel `sglang-0.5.23-cp311`), read from its source:

- `POST /generate` (`sglang/srt/entrypoints/http_server.py`, body `GenerateReqInput` in
  `sglang/srt/managers/io_struct.py`): `rid`, `input_ids`, `sampling_params`, `stream`,
  `priority`, `return_logprob`, and for PD disaggregation `bootstrap_host`/`bootstrap_port`/
  `bootstrap_room`. A stream is SSE lines `data: {"text", "output_ids", "meta_info"}` ending with
  `data: [DONE]`; `output_ids` is cumulative unless the server runs with
  `--incremental-streaming-output` (`managers/tokenizer_manager.py`), so `new_token_ids` reads
  both from `meta_info.completion_tokens`. An error mid-stream is `data: {"error": {...}}`.
- `sampling_params` (`sglang/srt/sampling/sampling_params.py`): `max_new_tokens` (128 when
  absent), `temperature`, `top_p`, `top_k` (-1 = whole vocabulary), `stop_token_ids`,
  `ignore_eos`, `sampling_seed`; an unknown key is refused.
- `POST /abort_request` body `AbortReq` (`rid`, `abort_all`): rids are matched by prefix, so
  every rid here has the same length (`new_rid`) and none is a prefix of another.
- `GET /v1/loads` (`sglang/srt/entrypoints/v1_loads.py`, fields of `LoadSnapshot` in
  `managers/load_snapshot.py`): `{"loads": [{"num_running_reqs", "num_waiting_reqs",
  "num_used_tokens", "max_total_num_tokens", "token_usage", "gen_throughput", ...}]}` per DP rank.
- Priority scheduling (`sglang/srt/arg_groups/fields/schedule.py`): with
  `--enable-priority-scheduling` a larger `priority` runs first and a waiting request whose
  priority exceeds a running one's by `--priority-scheduling-preemption-threshold` (10) retracts
  it; the retracted request keeps its generated tokens and is recomputed later.

Nothing here does I/O; `services/instance/sglang/` does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tidal.engine.api import EngineRequest, FinishReason, SamplingParams
from tidal.schemas.enums import RequestClass

SGLANG_VERSION = "0.5.23"  # the release this mapping was read from
# request class -> SGLang priority; the gap is far above the default preemption threshold (10)
PRIORITY = {RequestClass.ONLINE: 100, RequestClass.OFFLINE: 0}
RID_PREFIX = "tidal-"


def new_rid() -> str:
    """A rid for one submission to SGLang. All have the same length, so `/abort_request`'s
    prefix match never reaches another request."""
    return RID_PREFIX + uuid.uuid4().hex


def server_args(model: str, host: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """`python -m sglang.launch_server` arguments. Priority scheduling with preemption lets
    online work retract offline work inside SGLang's own scheduler; `fcfs` because priority
    scheduling accepts only `fcfs` or `lof`, and it keeps arrival order within a class, as
    Tidal's queues do. `extra` (`--sglang-args`) is appended and wins."""
    return [
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--enable-priority-scheduling",
        "--schedule-policy",
        "fcfs",
        "--default-priority-value",
        str(PRIORITY[RequestClass.OFFLINE]),
        "--enable-metrics",
        *extra,
    ]


def sampling_params(sp: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """Tidal's sampling as SGLang's `sampling_params`. Stop strings stay with Tidal (its
    `Detokenizer` cuts them and holds back a partial one, exactly as the torch engine does);
    SGLang gets the token-level stops."""
    out: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "ignore_eos": sp.ignore_eos,
        "skip_special_tokens": False,
    }
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None:
        out["sampling_seed"] = sp.seed
    return out


def generate_body(
    rid: str,
    input_ids: list[int],
    sp: SamplingParams,
    max_new_tokens: int,
    req_class: RequestClass,
    bootstrap: tuple[str, int, int] | None = None,
) -> dict[str, Any]:
    """A streamed native `/generate` request. `bootstrap` (host, port, room) pairs it with a
    prefill server under SGLang's PD disaggregation."""
    if not input_ids:
        raise ValueError("input_ids is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": sampling_params(sp, max_new_tokens),
        "stream": True,
        "priority": PRIORITY[req_class],
    }
    if sp.logprobs is not None:
        body["return_logprob"] = True
    if bootstrap is not None:
        body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"] = bootstrap
    return body


@dataclass(frozen=True)
class ChunkUpdate:
    """What one streamed `/generate` chunk adds to a request."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: FinishReason | None
    error: str = ""  # SGLang's message when it failed or aborted the request
    completion_tokens: int = 0  # cumulative, for this submission
    stop_token: int | None = None  # the EOS / stop token id that ended it (its text is not shown)


FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def parse_chunk(obj: Mapping[str, Any], seen: int) -> ChunkUpdate:
    """One decoded `data:` object of a `/generate` stream, given the `seen` tokens of this
    submission already taken. ValueError for a chunk that is not SGLang's shape."""
    if "error" in obj:
        err = obj["error"]
        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return ChunkUpdate(
            (), (), FinishReason.ERROR, error=f"SGLang: {msg}", completion_tokens=seen
        )
    meta = obj.get("meta_info")
    ids = obj.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(ids, list):
        raise ValueError("a /generate chunk without meta_info or output_ids")
    total = int(meta.get("completion_tokens", seen + len(ids)))
    # cumulative ids (the default) or only this chunk's (--incremental-streaming-output): the
    # new ones are the last `total - seen` either way
    n_new = max(0, min(total - seen, len(ids)))
    new = tuple(int(t) for t in ids[len(ids) - n_new :]) if n_new else ()
    lps: tuple[float, ...] = ()
    out_lps = meta.get("output_token_logprobs")
    if isinstance(out_lps, list) and n_new and len(out_lps) >= n_new:
        lps = tuple(float(e[0]) for e in out_lps[len(out_lps) - n_new :])
    finish, error, stop_token = None, "", None
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):
        kind = str(fr.get("type", ""))
        finish = FINISH.get(kind, FinishReason.ERROR)
        if finish in (FinishReason.ABORT, FinishReason.ERROR):
            error = f"SGLang {kind or 'finish'}: {fr.get('message', '')}".strip()
        matched = fr.get("matched")
        if (
            finish is FinishReason.STOP
            and isinstance(matched, int)
            and not isinstance(matched, bool)
        ):
            stop_token = matched
    elif isinstance(fr, str):
        finish = FINISH.get(fr, FinishReason.ERROR)
    return ChunkUpdate(new, lps, finish, error, seen + n_new, stop_token)


@dataclass(frozen=True)
class SglangLoad:
    """`/v1/loads`, summed over DP ranks."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_tokens: int = 0
    max_total_tokens: int = 0
    token_usage: float = 0.0  # KV usage, 0-1 (the busiest rank)
    gen_throughput: float = 0.0  # output tokens/s


def parse_loads(obj: Mapping[str, Any]) -> SglangLoad:
    loads = obj.get("loads")
    if not isinstance(loads, list):
        raise ValueError("/v1/loads answer has no 'loads' list")
    r = w = used = total = 0
    usage = tput = 0.0
    for d in loads:
        if not isinstance(d, dict):
            raise ValueError("/v1/loads entry is not an object")
        r += int(d.get("num_running_reqs", 0))
        w += int(d.get("num_waiting_reqs", 0))
        used += int(d.get("num_used_tokens", 0))
        total += int(d.get("max_total_num_tokens", 0))
        usage = max(usage, float(d.get("token_usage", 0.0)))
        tput += float(d.get("gen_throughput", 0.0))
    return SglangLoad(r, w, used, total, usage, tput)


@dataclass(frozen=True)
class RecomputePayload:
    """What a migration on this backend carries instead of KV: the request, the tokens it
    generated and how much of their text the client has (`Detokenizer.emitted`)."""

    KIND = "tidal-sglang-recompute/1"

    model: str
    req: EngineRequest
    output_ids: list[int]
    logprobs: list[float]
    emitted: str

    def encode(self) -> bytes:
        r, sp = self.req, self.req.sampling
        sampling = {
            "max_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "seed": sp.seed,
            "stop": list(sp.stop),
            "stop_token_ids": list(sp.stop_token_ids),
            "ignore_eos": sp.ignore_eos,
            "logprobs": sp.logprobs,
        }
        obj = {
            "kind": self.KIND,
            "model": self.model,
            "req_id": r.req_id,
            "req_class": str(r.req_class),
            "arrival_s": r.arrival_s,
            "prompt_token_ids": r.prompt_token_ids,
            "sampling": sampling,
            "output_ids": self.output_ids,
            "logprobs": self.logprobs,
            "emitted": self.emitted,
        }
        return json.dumps(obj).encode()

    @classmethod
    def decode(cls, data: bytes) -> RecomputePayload:
        """ValueError for a foreign or corrupt payload."""
        try:
            p = json.loads(data)
            if not isinstance(p, dict) or p.get("kind") != cls.KIND:
                raise ValueError("not an SGLang recompute payload")
            s = p["sampling"]
            sp = SamplingParams(
                **{**s, "stop": tuple(s["stop"]), "stop_token_ids": tuple(s["stop_token_ids"])}
            )
            req = EngineRequest(
                str(p["req_id"]),
                [int(t) for t in p["prompt_token_ids"]],
                sp,
                RequestClass(p["req_class"]),
                float(p["arrival_s"]),
            )
            return cls(
                str(p["model"]),
                req,
                [int(t) for t in p["output_ids"]],
                [float(x) for x in p["logprobs"]],
                str(p["emitted"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if "not an SGLang" in str(exc):
                raise
            raise ValueError(f"corrupt SGLang migration payload: {exc}") from None
