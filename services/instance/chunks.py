"""A request's tokens on their way to the gateway as `TokenChunk`s: one chunk per engine step
for an online request; for an offline one (no SLO: Batch API lines, `request_class: offline`)
several steps' tokens held back and published as one chunk.

One NATS message per token per request cost an instance 7-8 % of its loop thread in socket
writes under the co-location benchmark, and woke the gateway and the batch service per token.
Offline requests have no TPOT SLO, so their tokens wait until `Coalescing.max_tokens` are held,
the oldest is `Coalescing.max_age_s` old, or the request ends. The policy still sees every token
when it is made (`PolicyAdapter.on_tokens`); only the publish waits.

`seq` numbers chunks, not tokens: a held chunk takes its `seq` when it is published, so the
numbering the gateway checks for gaps stays contiguous, and whatever leaves the instance
(migration, cancel, drain) publishes what it holds first (`Instance.flush`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from tidal.engine.api import ControllableEngine, TokenEvent
from tidal.schemas.messages import TokenChunk

# Far below the gateway's silent-stream check (`services.common.client.resync.STALL_S`,
# 10 s): a held chunk must never make a live stream look lost.
MAX_AGE_LIMIT_S = 2.0


@dataclass(frozen=True)
class Coalescing:
    """How long an offline request's tokens may wait to be published together."""

    max_tokens: int = 32
    """publish an offline request's held tokens once this many are held (0 or 1: every step)"""
    max_age_s: float = 0.25
    """...or once the oldest held token is this old (0: every step)"""

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"offline chunk tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.max_age_s <= MAX_AGE_LIMIT_S:
            raise ValueError(
                f"offline chunk age must be in [0, {MAX_AGE_LIMIT_S}] s (the gateway checks "
                f"streams silent for 10 s), got {self.max_age_s}"
            )

    @property
    def is_on(self) -> bool:
        return self.max_tokens > 1 and self.max_age_s > 0


def build_chunk(
    ev: TokenEvent, stream: Stream, instance_id: str, engine: ControllableEngine
) -> TokenChunk:
    """`ev` as the chunk numbered `stream.seq` (renumbered when it is held back)."""
    return TokenChunk(
        req_id=ev.req_id,
        seq=stream.seq,
        text=ev.text,
        num_tokens=len(ev.token_ids),
        num_prompt_tokens=ev.num_prompt_tokens - stream.num_prev_output,
        num_output_tokens=ev.num_output_tokens + stream.num_prev_output,
        instance_id=instance_id,
        finish_reason=None if ev.finish_reason is None else str(ev.finish_reason),
        logprobs=list(ev.logprobs),
        tokens=_token_texts(engine, ev.token_ids) if ev.logprobs else [],
        top_logprobs=[
            list(
                zip(
                    _token_texts(engine, [t for t, _ in top]),
                    [lp for _, lp in top],
                    strict=True,
                )
            )
            for top in ev.top_logprobs
        ],
        is_emulated=engine.is_emulated,
        error=ev.error,
        token_ids=list(ev.token_ids),
    )


def _token_texts(engine: ControllableEngine, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text, as OpenAI's logprobs list it (a token holding part of a UTF-8
    character reads as U+FFFD)."""
    return [engine.tokenizer.decode([t]) for t in token_ids]


def merge(chunks: Sequence[TokenChunk], seq: int) -> TokenChunk:
    """`chunks` of one request, in order, as one chunk numbered `seq`: texts and per-token lists
    concatenated; counts, finish and error those of the last."""
    last = chunks[-1]
    if len(chunks) == 1:
        return last if last.seq == seq else msgspec.structs.replace(last, seq=seq)
    return msgspec.structs.replace(
        last,
        seq=seq,
        text="".join(c.text for c in chunks),
        num_tokens=sum(c.num_tokens for c in chunks),
        logprobs=[x for c in chunks for x in c.logprobs],
        tokens=[x for c in chunks for x in c.tokens],
        top_logprobs=[x for c in chunks for x in c.top_logprobs],
        token_ids=[x for c in chunks for x in c.token_ids],
    )


@dataclass
class Stream:
    """Where a request's tokens go, the seq of its next chunk, and what is held back."""

    reply_subject: str
    seq: int = 0
    num_prev_output: int = 0  # tokens streamed before a recompute resumed it elsewhere
    held: list[TokenChunk] = field(default_factory=list)  # built, not yet published
    num_held_tokens: int = 0
    held_since_s: float = 0.0  # Unix time the oldest held chunk was made

    def hold(self, chunk: TokenChunk, now_s: float) -> None:
        if not self.held:
            self.held_since_s = now_s
        self.held.append(chunk)
        self.num_held_tokens += chunk.num_tokens

    def is_due(self, now_s: float, cfg: Coalescing) -> bool:
        return bool(self.held) and (
            self.num_held_tokens >= cfg.max_tokens or now_s - self.held_since_s >= cfg.max_age_s
        )

    def take(self) -> TokenChunk | None:
        """What is held, as one chunk numbered `seq` (which moves on); None if nothing is."""
        if not self.held:
            return None
        chunk = merge(self.held, self.seq)
        self.seq += 1
        self.held = []
        self.num_held_tokens = 0
        return chunk
