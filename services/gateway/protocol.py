"""OpenAI-compatible request bodies, plus Tidal's request class and SLO fields.

Tidal's extensions (body field, or the equivalent header; the body wins when both are given):
  request_class  / X-Tidal-Class     "online" (default) or "offline"
  slo_ttft_ms    / X-Tidal-TTFT-Ms   this request's time-to-first-token target, ms
  slo_tpot_ms    / X-Tidal-TPOT-Ms   this request's time-per-output-token target, ms
  top_k, ignore_eos                  sampling extensions, as in vLLM
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.schemas.messages import ChatMessage, SamplingSpec

DEFAULT_CHAT_MAX_TOKENS = 512  # when the client sets none: clipped to the context left
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    request_class: Literal["online", "offline"] | None = None
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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
        )


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return prompt

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
        )


def resolve_class_and_slo(
    body: _Common, headers: dict[str, str]
) -> tuple[str, float | None, float | None]:
    """The request class and SLO targets from the body, else the X-Tidal-* headers."""
    req_class = body.request_class or headers.get("x-tidal-class", "online").strip().lower()
    if req_class not in ("online", "offline"):
        raise ApiError(
            400,
            f"X-Tidal-Class must be online or offline, got {req_class!r}",
            param="request_class",
        )
    slos: list[float | None] = []
    for field, header in (("slo_ttft_ms", "x-tidal-ttft-ms"), ("slo_tpot_ms", "x-tidal-tpot-ms")):
        value: float | None = getattr(body, field)
        if value is None and header in headers:
            try:
                value = float(headers[header])
            except ValueError:
                raise ApiError(400, f"{header} must be a number of ms", param=field) from None
            if not value > 0:
                raise ApiError(400, f"{header} must be > 0 ms", param=field)
        slos.append(value)
    return req_class, slos[0], slos[1]
