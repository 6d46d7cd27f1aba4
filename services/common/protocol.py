"""OpenAI-compatible request bodies, plus Tidal's request class and SLO fields.

Tidal's extensions (body field, or the equivalent header; the body wins when both are given):
  request_class  / X-Tidal-Class     a class of the cluster config (built in: online, offline)
  slo_ttft_ms    / X-Tidal-TTFT-Ms   this request's time-to-first-token target, ms
  slo_tpot_ms    / X-Tidal-TPOT-Ms   this request's time-per-output-token target, ms
  top_k, ignore_eos                  sampling extensions, as in vLLM

A field the server would accept but not honour is refused with a 400 naming it (`param`), never
silently ignored: see `unsupported()` and docs/api.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.config.classes import ClassError, ClassTable, RequestClassSpec, default_table
from tidal.schemas.messages import ChatMessage, SamplingSpec

DEFAULT_CHAT_MAX_TOKENS = 512  # when the client sets none: clipped to the context left
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# What the endpoints accept, stated in the models so the OpenAPI schema says it too. Every
# integer is bounded: the request goes on the bus as MessagePack, which holds at most 64 bits.
MAX_TOKENS_LIMIT = 2**31 - 1  # any value over the model's context length is a 400 anyway
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is an int64
TOP_K_LIMIT = 2**31 - 1  # larger than any vocabulary: the same as no top-k
# SLO targets: 1 µs to one day. Below 1e-3 ms, ms -> s could underflow to 0 on the way.
SLO_MIN_MS, SLO_MAX_MS = 1e-3, 86_400_000.0
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16  # n: each choice is a request of its own on the instances
LOGIT_BIAS_MAX = 100.0  # OpenAI's range, [-100, 100]
# Fields the endpoints accept without honouring them because they do not change the answer.
_HARMLESS = {
    "user": None,  # an end-user id, for abuse monitoring
    "metadata": None,  # tags for stored completions (nothing is stored)
    "safety_identifier": None,
    "prompt_cache_key": None,  # a cache hint (the prefix cache keys on tokens)
    "store": (False,),  # only "do not store"
    "service_tier": ("auto", "default"),
    "parallel_tool_calls": (True,),  # the default; meaningless without tools
}


class ApiError(Exception):
    """An error returned to the client in OpenAI's error format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


_SloMs = Annotated[float, Field(ge=SLO_MIN_MS, le=SLO_MAX_MS)]
# NOTE: pydantic's own schema states the int64 bounds exactly; FastAPI's /openapi.json still
# writes them as floats (2**63 - 1 reads as 2**63, which the endpoint refuses with a 400).
_Seed = Annotated[
    int,
    Field(ge=SEED_MIN, le=SEED_MAX, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX}),
]


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Common(BaseModel):
    # NaN and ±Infinity (which Python's JSON parser reads) are refused in every float field.
    # Unknown fields are kept (extra="allow") so that `unsupported()` can refuse them by name.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=TOP_K_LIMIT, description="0: no top-k")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: _Seed | None = None
    frequency_penalty: _Penalty = 0.0
    presence_penalty: _Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]] | None = (
        None
    )
    response_format: ResponseFormat | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    ignore_eos: bool = False
    request_class: str | None = Field(
        None, max_length=64, description="a request class of the cluster config (docs/classes.md)"
    )
    slo_ttft_ms: _SloMs | None = None
    slo_tpot_ms: _SloMs | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return bias

    def bias_pairs(self) -> list[tuple[int, float]]:
        return [(int(k), v) for k, v in (self.logit_bias or {}).items()]

    def unsupported(self) -> ApiError | None:
        """A 400 naming the first field this server would not honour, else None."""
        for name, value in (self.model_extra or {}).items():
            if value is None or value == [] or value == {}:
                continue  # unset, as a client writes a field it does not use
            allowed = _HARMLESS.get(name, ())
            if name in _HARMLESS and (allowed is None or value in allowed):
                continue
            return ApiError(
                400,
                f"{name} is not supported by this server",
                code="unsupported_parameter",
                param=name,
            )
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            return ApiError(
                400,
                f"response_format type {fmt.type!r} is not supported (no constrained decoding "
                "here); only 'text'",
                code="unsupported_parameter",
                param="response_format",
            )
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def chat_messages(self) -> list[ChatMessage]:
        return [ChatMessage(role=m.role, content=m.text()) for m in self.messages]

    def sampling(self) -> SamplingSpec:
        limit = self.max_completion_tokens or self.max_tokens
        return SamplingSpec(
            max_tokens=limit or DEFAULT_CHAT_MAX_TOKENS,
            max_tokens_is_default=limit is None,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=self.bias_pairs(),
        )

    def unsupported(self) -> ApiError | None:
        if self.top_logprobs and not self.logprobs:
            return ApiError(
                400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs"
            )
        return super().unsupported()


class CompletionRequest(_Common):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
        description="one prompt per request: a string, or a list holding one string"
    )
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(False, json_schema_extra={"enum": [False]}, description="not supported")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def sampling(self) -> SamplingSpec:
        return SamplingSpec(
            max_tokens=self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=self.bias_pairs(),
        )


def asked_class(body: _Common, headers: dict[str, str]) -> str | None:
    """The request class the request names (body, else header), lower-cased; None: none."""
    asked = body.request_class or headers.get("x-tidal-class", "")
    return asked.strip().lower() or None


def resolve_class_and_slo(
    body: _Common,
    headers: dict[str, str],
    classes: ClassTable | None = None,
    key: str | None = None,
) -> tuple[RequestClassSpec, float | None, float | None]:
    """The request class (from the body, else the X-Tidal-Class header, as the API `key`'s
    rule allows; default: the built-in pair) and its own SLO targets, else the X-Tidal-*
    headers'. ApiError 400 naming the classes for a class it may not have."""
    table = classes or default_table()
    try:
        spec = table.resolve(asked_class(body, headers), key)
    except ClassError as exc:
        raise ApiError(
            400, f"X-Tidal-Class / request_class: {exc}", param="request_class"
        ) from None
    slos: list[float | None] = []
    for field, header in (("slo_ttft_ms", "x-tidal-ttft-ms"), ("slo_tpot_ms", "x-tidal-tpot-ms")):
        value: float | None = getattr(body, field)
        if value is None and header in headers:
            try:
                value = float(headers[header])
            except ValueError:
                raise ApiError(400, f"{header} must be a number of ms", param=field) from None
            if not SLO_MIN_MS <= value <= SLO_MAX_MS:  # NaN fails this too
                raise ApiError(
                    400,
                    f"{header} must be between {SLO_MIN_MS} and {SLO_MAX_MS:.0f} ms",
                    param=field,
                )
        slos.append(value)
    return spec, slos[0], slos[1]
