"""BatchShape arithmetic shared by the co-location policies (OOCO, HyGen, TaiChi, OmniServe, Tidal).

Every algorithm in the four papers asks the same question — "how long would this step take if I
added that request?" — so they all build a `tidal.perf.BatchShape` incrementally and hand it to a
`StepModel`. These helpers keep that arithmetic in one place and allocation-light.

`LinearStepModel` is a tiny linear stand-in for the real latency models in `tidal.perf`; the unit
tests and the decision benchmark use it so that hand-worked states have hand-checkable latencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.perf.api import BatchShape

EMPTY = BatchShape()


def add_decode(shape: BatchShape, num_reqs: int, context_tokens: int) -> BatchShape:
    """`shape` plus `num_reqs` decoding requests whose KV lengths sum to `context_tokens`."""
    return BatchShape(
        num_prefill_tokens=shape.num_prefill_tokens,
        num_prefill_reqs=shape.num_prefill_reqs,
        prefill_attn_pairs=shape.prefill_attn_pairs,
        num_decode_reqs=shape.num_decode_reqs + num_reqs,
        decode_context_tokens=shape.decode_context_tokens + context_tokens,
    )


def add_prefill(shape: BatchShape, new_tokens: int, cached_tokens: int) -> BatchShape:
    """`shape` plus one prefill chunk of `new_tokens` after `cached_tokens` already in KV."""
    if new_tokens <= 0:
        return shape
    return BatchShape(
        num_prefill_tokens=shape.num_prefill_tokens + new_tokens,
        num_prefill_reqs=shape.num_prefill_reqs + 1,
        prefill_attn_pairs=shape.prefill_attn_pairs + new_tokens * (cached_tokens + new_tokens),
        num_decode_reqs=shape.num_decode_reqs,
        decode_context_tokens=shape.decode_context_tokens,
    )


def merge(a: BatchShape, b: BatchShape) -> BatchShape:
    """The step that runs both `a` and `b`."""
    return BatchShape(
        num_prefill_tokens=a.num_prefill_tokens + b.num_prefill_tokens,
        num_prefill_reqs=a.num_prefill_reqs + b.num_prefill_reqs,
        prefill_attn_pairs=a.prefill_attn_pairs + b.prefill_attn_pairs,
        num_decode_reqs=a.num_decode_reqs + b.num_decode_reqs,
        decode_context_tokens=a.decode_context_tokens + b.decode_context_tokens,
    )


def decode_shape(context_lens: list[int]) -> BatchShape:
    """A pure decode step over requests with these KV lengths."""
    return BatchShape(num_decode_reqs=len(context_lens), decode_context_tokens=sum(context_lens))


@dataclass(frozen=True, slots=True)
class LinearStepModel:
    """step_s = base + per_token*num_tokens + per_ctx*decode_ctx + per_pair*attn_pairs (seconds).

    A hand-checkable stand-in for the roofline / regression models: monotone in every term, which
    is the only property the scheduling algorithms rely on (binary searches need monotonicity).
    """

    base_s: float = 0.010  # fixed per-step overhead (kernel launches, sampling)
    per_token_s: float = 1e-5  # GEMM cost per token through the token-wise operators
    per_ctx_token_s: float = 1e-7  # decode attention cost per KV token read
    per_attn_pair_s: float = 1e-9  # prefill attention cost per (query, key) pair

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_token_s, self.per_ctx_token_s, self.per_attn_pair_s) < 0:
            raise ValueError("LinearStepModel coefficients must be >= 0 (latency is monotone)")

    def step_s(self, batch: BatchShape) -> float:
        """Predicted step time in seconds."""
        return (
            self.base_s
            + self.per_token_s * (batch.num_prefill_tokens + batch.num_decode_reqs)
            + self.per_ctx_token_s * batch.decode_context_tokens
            + self.per_attn_pair_s * batch.prefill_attn_pairs
        )
