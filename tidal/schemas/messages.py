"""Every message Tidal sends over NATS, as typed structs. Nothing else lives here.

Data messages travel as MessagePack (`tidal.schemas.codec`); control messages (`Ctl*`) travel as
JSON so a person can type them with the NATS CLI. Fields carry their unit in the name. Subject
names are built by `tidal.schemas.subjects`.
"""

from __future__ import annotations

import msgspec


class InstanceLoad(msgspec.Struct, frozen=True):
    """An instance's load, carried in its heartbeat."""

    num_running: int  # requests holding KV and being stepped
    num_waiting: int  # requests queued, no KV yet
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_online: int  # online requests on the instance (running + waiting)
    num_offline: int  # offline requests on the instance (running + waiting)
    num_steps: int = 0  # engine steps since start
    last_step_ms: float = 0.0  # duration of the last step (emulated for an emulated engine)


class Heartbeat(msgspec.Struct, frozen=True):
    """Every service publishes one every `heartbeat_s` on `subjects.heartbeat(kind, id)`."""

    service_id: str
    kind: str  # "gateway" | "scheduler" | "instance" | "cpu_attn"
    pid: int
    started_unix_s: float
    sent_unix_s: float
    status: str = "ok"  # "ok" | "draining" (a draining service takes no new work)
    role: str = ""  # instance role: "aggregated" | "relaxed" | "strict" | ...
    engine: str = ""  # instance engine: "sim" | "torch"
    model: str = ""  # model id an instance serves
    is_emulated: bool = False  # True when the engine's timings are emulated (sim engine)
    load: InstanceLoad | None = None  # instances only
    info: dict[str, str] = {}  # free-form details for `tidal ctl status`


class RouteRequest(msgspec.Struct, frozen=True):
    """Gateway -> scheduler: where should this request run?"""

    req_id: str
    model: str
    req_class: str  # "online" | "offline"
    max_tokens: int
    num_prompt_chars: int  # a length hint; instances tokenise
    exclude: list[str] = []  # instance ids that already failed this request


class RouteReply(msgspec.Struct, frozen=True):
    """Scheduler -> gateway. Either `instance_id` is set, or `error_code` says why not."""

    instance_id: str = ""
    error_code: str = ""  # "" | "unknown_model" | "no_capacity" | "offline_paused"
    message: str = ""
    retry_after_s: float = 0.0  # set with "no_capacity" / "offline_paused"


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class SamplingSpec(msgspec.Struct, frozen=True):
    """Wire form of `tidal.engine.api.SamplingParams`."""

    max_tokens: int
    max_tokens_is_default: bool = False  # client set none: clip to the context left, not reject
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None


class GenerateRequest(msgspec.Struct, frozen=True):
    """Gateway -> instance (request/reply; the reply is a `GenerateAck`)."""

    req_id: str
    model: str
    sampling: SamplingSpec
    reply_subject: str  # where the instance publishes `TokenChunk`s
    req_class: str = "online"
    prompt: str | None = None  # /v1/completions
    messages: list[ChatMessage] | None = None  # /v1/chat/completions
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    arrival_unix_s: float = 0.0


class GenerateAck(msgspec.Struct, frozen=True):
    """Instance -> gateway: accepted (tokenised and queued), or rejected with a client error."""

    ok: bool
    num_prompt_tokens: int = 0
    error_code: str = ""  # "" | "context_length_exceeded" | "invalid_request" | "draining"
    message: str = ""
    engine: str = ""  # "sim" | "torch"
    is_emulated: bool = False  # the engine's timings are emulated (sim engine)


class TokenChunk(msgspec.Struct, frozen=True):
    """Instance -> gateway: one request's tokens from one engine step."""

    req_id: str
    seq: int  # 0, 1, 2, ... per request, so the gateway can detect gaps
    text: str
    num_tokens: int  # tokens in this chunk
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    instance_id: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    logprobs: list[float] = []
    is_emulated: bool = False
    error: str = ""


class CancelRequest(msgspec.Struct, frozen=True):
    """Gateway -> every instance: drop this request wherever it runs."""

    req_id: str
    reason: str = "client disconnected"


class InstanceDown(msgspec.Struct, frozen=True):
    """Scheduler -> gateways: this instance stopped heartbeating; its requests are lost there."""

    instance_id: str
    reason: str


# ---- control plane (JSON) ----


class CtlOfflineAdmission(msgspec.Struct, frozen=True):
    """Reply to `tidal.ctl.offline.pause|resume`."""

    offline_paused: bool


class CtlError(msgspec.Struct, frozen=True):
    error: str
