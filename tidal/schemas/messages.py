"""Every data message Tidal sends over NATS, as typed structs. Nothing else lives here.

Data messages travel as MessagePack (`tidal.schemas.codec`); the control messages (`Ctl*`), which
travel as JSON so a person can type them with the NATS CLI, are in `tidal.schemas.control`.
Fields carry their unit in the name. Subject names are built by `tidal.schemas.subjects`.
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
    """Gateway -> scheduler: where should this request run? The reply may come late: a request
    the policy holds (`Route.hold`) is answered when `tick` dispatches it."""

    req_id: str
    model: str
    req_class: str  # "online" | "offline"
    max_tokens: int
    num_prompt_chars: int  # a length hint; instances tokenise
    exclude: list[str] = []  # instance ids that already failed this request
    # When the last of them failed it: an instance (re)started after that is another process
    # under the same id, and may take the request.
    excluded_at_unix_s: float = 0.0
    num_prompt_tokens: int = 0  # the gateway's estimate (0: the scheduler estimates from chars)
    ttft_slo_ms: float | None = None  # online only; None: the scheduler's default SLO
    tpot_slo_ms: float | None = None
    max_tokens_is_default: bool = False  # the client set none (`SamplingSpec`'s)
    # Its request class (`tidal.config.classes`): its name and priority (higher is served
    # first). "" / 0 from a peer that predates classes: the kind alone (`req_class`) counts.
    class_name: str = ""
    priority: int = 0
    slo_admission: bool = True  # False: the policy's admission control never refuses it


class RouteReply(msgspec.Struct, frozen=True):
    """Scheduler -> gateway. Either `instance_id` is set, or `error_code` says why not."""

    instance_id: str = ""
    error_code: str = ""  # "" | "unknown_model" | "no_capacity" | "offline_paused"
    # | "rejected" (the policy's admission control) | "queue_full" (the held queue is full)
    message: str = ""
    retry_after_s: float = 0.0  # set with every error but "unknown_model"
    # The routed instance's process, as its latest report names it (`started_unix_s`): if it
    # does not take the request, the gateway excludes that process and no later one.
    instance_started_unix_s: float = 0.0
    # The scheduler's default SLO, which an online request that names none is held to (0: none
    # configured). The gateway counts SLO attainment against it.
    default_ttft_slo_s: float = 0.0
    default_tpot_slo_s: float = 0.0


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
    logprobs: int | None = None  # top log-probs per token (0: only the chosen token's)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: list[tuple[int, float]] = []  # (token id, bias)


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
    # Recompute after a lost instance: tokens the client already has, fed as input and never
    # streamed again; `seq` of the first new chunk continues from `first_seq`.
    resume_token_ids: list[int] = []
    first_seq: int = 0
    class_name: str = ""  # its request class's name ("": the kind, `req_class`)
    priority: int = 0  # its request class's priority (higher is served first)
    slo_admission: bool = True  # its class's admission: False, never refused for its SLO


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
    # with logprobs: each token's text, and its top alternatives as (text, log-prob) pairs
    tokens: list[str] = []
    top_logprobs: list[list[tuple[str, float]]] = []
    token_ids: list[int] = []  # the chunk's tokens (a recompute resumes from them)
    # Not tokens: the request migrated to this instance id; its next chunk (this `seq`) comes
    # from there. The gateway follows it.
    moved_to: str = ""
    is_emulated: bool = False
    error: str = ""


class ReqReport(msgspec.Struct, frozen=True, array_like=True):
    """One request on an instance, as its `InstanceReport` carries it (`tidal.policy.ReqState`'s
    fields that a live system knows). Times are Unix seconds."""

    req_id: str
    req_class: str  # "online" | "offline"
    phase: str  # a `tidal.policy.Phase` value: waiting | running | swapped | offloaded | migrating
    arrival_unix_s: float
    num_prompt_tokens: int
    max_output_tokens: int  # the request's max_tokens (a live system does not know the true one)
    num_computed_tokens: int  # tokens whose KV is resident
    num_output_tokens: int
    num_blocks: int  # GPU KV blocks it holds
    ttft_slo_s: float = 0.0  # online only (0: none)
    tpot_slo_s: float = 0.0
    start_unix_s: float = 0.0  # first computed (0: not yet)
    first_token_unix_s: float = 0.0
    last_token_unix_s: float = 0.0
    max_tbt_s: float = 0.0
    num_preemptions: int = 0
    num_migrations: int = 0
    priority: int = 0  # its request class's priority (0 from a peer that predates classes)


class InstanceReport(msgspec.Struct, frozen=True):
    """Instance -> scheduler on `subjects.instance_state(id)`, after each step (rate-limited) and
    when idle: everything the scheduler's `ClusterView` holds about the instance."""

    instance_id: str
    index: int  # the instance's slot in the cluster (`InstanceState.instance_id`)
    seq: int  # increases by one per report; a late, older report is dropped
    sent_unix_s: float
    role: str
    chunk_size: int
    max_batch_reqs: int
    block_size: int
    num_blocks: int
    num_free_blocks: int
    kv_bytes_per_token: float
    step_model: str  # spec of its latency model (`--sim-step-model` syntax), for the policy
    data_url: str  # its KV data plane, "tcp://host:port"
    requests: list[ReqReport] = []
    busy_until_unix_s: float = 0.0  # end of the step in flight (0: idle)
    policy: str = ""  # the policy its instance half runs
    # State a policy's instance half leaves for its cluster half (`InstanceState.hints`), e.g.
    # OOCO's "every offline decode fit this step" that lets `tick` pull more.
    hints: dict[str, float] = {}
    draining: bool = False
    started_unix_s: float = 0.0  # when this process started (a restart under the same id
    # starts `seq` again at 1)
    num_preemptions: int = 0  # layer-boundary preemptions since start
    plan_refusals: dict[str, int] = {}  # `tidal.plan.RefusalReason` -> plans refused since start
    num_steps: int = 0
    last_step_ms: float = 0.0
    emulated: bool = False
    # Requests that ended here since the previous report: the scheduler stops counting a routed
    # request that finished before any report showed it (a short one ends within one interval).
    finished_req_ids: list[str] = []
    max_model_len: int = 0  # its model's context, tokens (0: not said)


class MigrateCommand(msgspec.Struct, frozen=True):
    """Scheduler -> source instance (request/reply on `subjects.instance_migrate(src)`): move
    `req_id`, KV included, to `dst_instance_id`. Answered by a `MigrateResult`."""

    req_id: str
    dst_instance_id: str
    kind: str  # "push" (online, after prefill) | "pull" (offline decode to a strict instance)


class MigrateResult(msgspec.Struct, frozen=True):
    """Source -> scheduler: what became of a `MigrateCommand`."""

    req_id: str
    outcome: str  # "ok" | "refused" | "failed" | "unknown_request" | "busy"
    message: str = ""
    num_bytes: int = 0
    transfer_s: float = 0.0
    total_s: float = 0.0
    mode: str = "kv"  # "kv": KV moved | "recompute": the target recomputes it (sglang engine)


# `MigrationEvent.mode` (`tidal_migrations_total{mode=...}`) of an SGLang P->D KV handoff
PD_MIGRATION_MODE = "pd_transfer"


class MigrationEvent(msgspec.Struct, frozen=True):
    """Scheduler -> anyone (`subjects.MIGRATION_EVENTS`): a migration ended (for metrics)."""

    req_id: str
    kind: str  # "push" | "pull"
    src_instance_id: str
    dst_instance_id: str
    outcome: str  # `MigrateResult.outcome`
    message: str = ""
    num_bytes: int = 0
    transfer_s: float = 0.0
    total_s: float = 0.0
    mode: str = "kv"  # `MigrateResult.mode`


class BatchStats(msgspec.Struct, frozen=True):
    """Batch service -> gateway (`subjects.BATCH_STATS`, once a second): the Batch API's metrics.
    Counters count since the batch service started; the gateway adds up restarts."""

    service_id: str
    started_unix_s: float
    batches_by_status: dict[str, int]
    lines_queued: int  # jobs on the stream not yet taken
    lines_in_flight: int
    lines_done_total: int  # results stored by this process, successes and failures
    lines_failed_total: int
    output_tokens_total: int  # of lines with a stored result, counted when stored
    oldest_job_age_s: float  # age of the oldest job still on the stream (0 when none)
    # tokens of batch lines as they are generated (lines retried or cancelled too): the batch
    # path's decode rate over any window, where `output_tokens_total` moves a line at a time
    generated_tokens_total: int = 0


class MigrateOffer(msgspec.Struct, frozen=True):
    """Source -> target (request/reply on `subjects.migrate_offer(dst)`): reserve room for this
    request's KV. The bytes then go over the data plane; nothing starts before the commit."""

    req_id: str
    src_instance_id: str
    kind: str  # "push" | "pull"
    num_kv_tokens: int
    num_bytes: int  # KV bytes that follow on the data plane (each chunk carries its CRC32C)
    reply_subject: str  # where the request's tokens go (the gateway's subject)
    next_seq: int  # seq of the next chunk the request will stream
    req_class: str
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0
    arrival_unix_s: float = 0.0
    # when its first token was made (0: not known): the target's policy counts the request's
    # TPOT from there, the hand-off included, as its client does
    first_token_unix_s: float = 0.0


class MigrateOfferReply(msgspec.Struct, frozen=True):
    ok: bool
    reason: str = ""  # why it refused: "no_room" | "draining" | "duplicate" | ...
    data_url: str = ""  # where to send the bytes ("tcp://host:port")
    ticket: str = ""  # names the reservation on the data plane and in the commit


class MigrateCommit(msgspec.Struct, frozen=True):
    """Source -> target (request/reply on `subjects.migrate_commit(dst)`) after the bytes landed
    and the source stopped the request: start running it. Answered by `MigrateOfferReply`."""

    req_id: str
    ticket: str


class MigrateAbort(msgspec.Struct, frozen=True):
    """Source -> target: drop the reservation (the source keeps or already re-took the request)."""

    req_id: str
    ticket: str
    reason: str = ""


class CancelRequest(msgspec.Struct, frozen=True):
    """Gateway -> every instance: drop this request wherever it runs."""

    req_id: str
    reason: str = "client disconnected"


class InstanceDown(msgspec.Struct, frozen=True):
    """Scheduler -> gateways: this instance stopped heartbeating; its requests are lost there."""

    instance_id: str
    reason: str
