"""One choice of an OpenAI request as the gateway serves it: its handle on the bus, its timing
and metrics, and its part of the response body (text, finish, logprobs) in OpenAI's format. A
request with `n` > 1 is `n` calls, one request each on the instances, under one response id."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.common.client.stream import RequestHandle
from services.gateway.metrics import GatewayMetrics, slo_attained
from tidal.schemas.messages import TokenChunk

FAILED = ("error", "abort")


@dataclass
class Call:
    kind: str  # "chat" | "completion"
    model: str
    req_class: str  # the request class it is served in (the kind's name without a table)
    handle: RequestHandle
    metrics: GatewayMetrics
    arrival_s: float
    index: int = 0  # the choice's index
    response_id: str = ""  # shared by every choice of the request
    demoted_from: str = ""  # the class it asked for, when it runs in a looser one
    created: int = field(default_factory=lambda: int(time.time()))
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_output: int = 0
    num_chars: int = 0  # text streamed so far (completions' logprobs.text_offset)

    @property
    def id(self) -> str:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return prefix + (self.response_id or self.handle.client_req_id)

    @property
    def emulated(self) -> str:
        return "true" if self.handle.ack.is_emulated else "false"

    def envelope(self, chunk: bool = False) -> dict[str, Any]:
        obj = "text_completion"
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "tidal-sim-emulated"
            if self.handle.ack.is_emulated
            else f"tidal-{self.handle.ack.engine}",
        }

    def tidal_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "request_class": self.req_class,
            **({"demoted_from": self.demoted_from} if self.demoted_from else {}),
            "instance": self.handle.instance_id,
            "engine": self.handle.ack.engine,
            "emulated": self.handle.ack.is_emulated,
        }
        if self.first_token_s is not None:
            # From the request reaching the gateway to its first token leaving the instance:
            # the server's share of TTFT, without the client's own time.
            info["server_ttft_ms"] = round((self.first_token_s - self.arrival_s) * 1e3, 3)
        return info

    def headers(self) -> dict[str, str]:
        out = {
            "X-Tidal-Emulated": self.emulated,
            "X-Tidal-Instance": self.handle.instance_id,
            "X-Tidal-Request-Id": self.response_id or self.handle.client_req_id,
            "X-Tidal-Class": self.req_class,
        }
        if self.demoted_from:
            out["X-Tidal-Demoted-From"] = self.demoted_from
        return out

    def observe(self, chunk: TokenChunk) -> None:
        if chunk.num_tokens == 0:
            return
        now = time.monotonic()
        vllm = self.metrics.vllm
        if self.first_token_s is None:
            self.first_token_s = now
            self.metrics.ttft.labels(self.req_class, self.emulated).observe(now - self.arrival_s)
            vllm.ttft.labels(self.model).observe(now - self.arrival_s)
            vllm.prompt_tokens.labels(self.model).inc(self.handle.ack.num_prompt_tokens)
        elif self.last_token_s is not None:
            # one sample per token: a chunk of k tokens after a gap g is k gaps of g / k
            itl = vllm.itl.labels(self.model)
            for _ in range(chunk.num_tokens):
                itl.observe((now - self.last_token_s) / chunk.num_tokens)
        self.last_token_s = now
        self.num_output += chunk.num_tokens
        self.metrics.output_tokens.labels(self.req_class, self.emulated).inc(chunk.num_tokens)
        vllm.generation_tokens.labels(self.model).inc(chunk.num_tokens)

    def finish(self, finish_reason: str | None) -> None:
        """The request ended (`finish_reason` None: the client left before its end)."""
        if finish_reason is not None:
            self.metrics.vllm.success.labels(self.model, finish_reason).inc()
            if finish_reason not in FAILED:
                e2e_s = time.monotonic() - self.arrival_s
                self.metrics.vllm.e2e.labels(self.model).observe(e2e_s)
        tpot = 0.0
        if self.first_token_s is not None and self.last_token_s is not None and self.num_output > 1:
            tpot = (self.last_token_s - self.first_token_s) / (self.num_output - 1)
            self.metrics.tpot.labels(self.req_class, self.emulated).observe(tpot)
        req = self.handle.request
        if req.req_class == "online" and self.first_token_s is not None:
            d = self.handle.default_slo
            slo = d.of_request(req.ttft_slo_ms, req.tpot_slo_ms) if d is not None else None
            targets_ms = (
                slo.ttft_s * 1e3 if slo else req.ttft_slo_ms or None,
                slo.tpot_s * 1e3 if slo else req.tpot_slo_ms or None,
            )
            ttft_s = self.first_token_s - self.arrival_s
            attained = slo_attained(ttft_s, tpot, *targets_ms)
            self.metrics.slo.labels(self.req_class, attained, self.emulated).inc()

    def choice(self, text: str | None, finish: str | None, chunks: list[TokenChunk]) -> dict:
        """This choice's entry in `choices`: a streamed delta (chat) or a whole text."""
        logprobs = self.logprobs(chunks) if any(c.logprobs for c in chunks) else None
        self.num_chars += len(text or "")
        out: dict[str, Any] = {"index": self.index}
        if self.kind == "chat":
            out["delta"] = {} if text is None else {"content": text}
        else:
            out["text"] = text or ""
        return out | {"logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, chunks: list[TokenChunk]) -> dict[str, Any]:
        """OpenAI's `logprobs` object for the tokens of `chunks`."""
        tokens: list[str] = []
        lps: list[float] = []
        tops: list[list[tuple[str, float]]] = []
        for c in chunks:
            if not c.logprobs:
                continue
            n = len(c.logprobs)
            if len(c.tokens) == n:
                tokens += c.tokens
            else:  # an engine that sends no token texts
                tokens += [c.text] if n == 1 else [""] * n
            lps += c.logprobs
            tops += c.top_logprobs if len(c.top_logprobs) == n else [[] for _ in range(n)]
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": t,
                        "logprob": lp,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {"token": a, "logprob": alp, "bytes": list(a.encode())}
                            for a, alp in top
                        ],
                    }
                    for t, lp, top in zip(tokens, lps, tops, strict=True)
                ]
            }
        offsets, at = [], self.num_chars
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": [dict(top) for top in tops],
            "text_offset": offsets,
        }


def usage(calls: list[Call]) -> dict[str, int]:
    """The request's usage: its prompt once, every choice's output."""
    prompt = calls[0].handle.ack.num_prompt_tokens
    completion = sum(c.num_output for c in calls)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
