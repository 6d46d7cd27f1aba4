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
- PD disaggregation (`sglang/srt/arg_groups/fields/disagg.py`, `disaggregation/`): a server
  runs with `--disaggregation-mode prefill|decode` and `--disaggregation-transfer-backend`
  (mooncake by default; nixl, mori, ascend, mooncake_tcp; `fake` on decode only); the prefill
  server's bootstrap server listens on `--disaggregation-bootstrap-port` (8998). `/server_info`
  reports every resolved server argument flat (`build_server_info` in `utils/common.py` over
  `ServerArgs.resolved_dict`), so `disaggregation_mode` and `disaggregation_bootstrap_port` can be
  read there. See `pd_*` below for the request side.
- Priority scheduling (`sglang/srt/arg_groups/fields/schedule.py`): with
  `--enable-priority-scheduling` a larger `priority` runs first and a waiting request whose
  priority exceeds a running one's by `--priority-scheduling-preemption-threshold` (10) retracts
  it; the retracted request keeps its generated tokens and is recomputed later.

Nothing here does I/O; `services/instance/sglang/` does.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tidal.engine.api import EngineRequest, FinishReason, SamplingParams
from tidal.schemas.enums import RequestClass

SGLANG_VERSION = "0.5.23"  # the release this mapping was read from
DEFAULT_BOOTSTRAP_PORT = 8998  # `--disaggregation-bootstrap-port` default (fields/disagg.py)
# a PD handoff's bound: SGLang's own SGLANG_DISAGGREGATION_WAITING_TIMEOUT (environ.py)
DEFAULT_HANDOFF_TIMEOUT_S = 300.0
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
    if sp.frequency_penalty:
        out["frequency_penalty"] = sp.frequency_penalty
    if sp.presence_penalty:
        out["presence_penalty"] = sp.presence_penalty
    if sp.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in sp.logit_bias}
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
    num_retractions: int = 0  # cumulative, for this submission: SGLang sent it back to waiting


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
    retractions = meta.get("num_retractions")  # managers/tokenizer_manager.py, every output
    n_retract = retractions if isinstance(retractions, int) and retractions > 0 else 0
    return ChunkUpdate(new, lps, finish, error, seen + n_new, stop_token, n_retract)


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
            "frequency_penalty": sp.frequency_penalty,
            "presence_penalty": sp.presence_penalty,
            "logit_bias": [list(pair) for pair in sp.logit_bias],
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
            bias = tuple((int(t), float(b)) for t, b in s.get("logit_bias", []))
            sp = SamplingParams(
                **{
                    **s,
                    "stop": tuple(s["stop"]),
                    "stop_token_ids": tuple(s["stop_token_ids"]),
                    "logit_bias": bias,
                }
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


# ---- PD disaggregation: one request sent to a prefill server and a decode server ----
#
# How SGLang's own routers pair a request (read, not run): `sglang/srt/disaggregation/mini_lb.py`
# (python, older releases) and `sgl-router/src/routers/pd_router.rs` (rust) both pick a prefill
# and a decode server, add `bootstrap_host` (the prefill URL's host), `bootstrap_port` (the
# prefill's bootstrap port) and `bootstrap_room` (`random.randint(0, 2**63 - 1)`; the router's
# `generate_room_id` masks a random u64 to i64::MAX, since the engine keeps rooms as int64) to
# the body, POST the same body to both at once, and stream the client only the decode server's
# answer; the prefill's answer is drained (read only to merge `input_token_logprobs`), and a
# prefill error is logged as non-critical. In the engine (0.5.23): the prefill server computes
# the prompt with `max_new_tokens` forced to 1 (`disaggregation/prefill.py` `_process_req`),
# pushes the KV to the decode server over the transfer backend, and answers only once the
# transfer is done, with `finish_reason` `{"type": "length", "length": 0}`, or an abort
# ("Prefill transfer failed ...", HTTP 500) when it failed; the decode server holds the request
# in its prealloc/transfer queues until the KV of its room lands and then streams every output
# token, the prefill's first one included (`disaggregation/decode.py`). A decode waiting for a
# room times out only after `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` / `..._BOOTSTRAP_TIMEOUT`
# (300 s each, `environ.py`); a request without a room is aborted at once ("Disaggregated request
# received without bootstrap room id", HTTP 400, `managers/scheduler.py`).


MAX_ROOM = 2**63 - 1  # rooms are int64 in the engine


def new_bootstrap_room() -> int:
    """A room for one PD submission, as SGLang's routers draw it: uniform in [0, 2**63 - 1]."""
    return random.randint(0, MAX_ROOM)


def bootstrap_host_of(prefill_url: str) -> str:
    """The host the decode server reaches the prefill's bootstrap server at: the prefill URL's
    host, as `mini_lb.py` takes it (IPv6 in brackets)."""
    host = urlsplit(prefill_url).hostname
    if not host:
        raise ValueError(f"no host in the prefill server URL {prefill_url!r}")
    return f"[{host}]" if ":" in host else host


def pd_prefill_body(decode_body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill server's copy of a PD submission. SGLang's routers send it the very body the
    decode server gets; here it is not streamed (`stream: false`), because the worker reads only
    how it ended: one JSON answer once the KV has been sent, or an HTTP error."""
    if "bootstrap_room" not in decode_body:
        raise ValueError("a PD submission needs bootstrap_host/port/room")
    return {**decode_body, "stream": False}


def prefill_outcome(status: int, obj: Any) -> str:
    """ "" when the prefill server's answer says the prompt was computed and its KV sent;
    else why not (an HTTP error, or SGLang's abort)."""
    if status != 200:
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        return f"prefill server: HTTP {status}: {str(msg)[:300]}"
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    if isinstance(obj, list) and obj:  # a batch answer: the first one
        meta = obj[0].get("meta_info") if isinstance(obj[0], dict) else None
    fr = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(fr, dict) and fr.get("type") == "abort":
        return f"prefill server aborted it: {fr.get('message', '')}".strip()
    if not isinstance(meta, dict):
        return "prefill server: an answer without meta_info"
    return ""
