"""`LinearStepModel`: the one hand-checkable linear latency model (tests, quick what-ifs, and the
`sim` engine's default emulated step time).

step_s = base + per_token * (prefill tokens + decodes) + per_decode_req * decodes
         + per_ctx_token * decode context tokens + per_attn_pair * prefill attention pairs

Monotone in every term, which is the only property the scheduling algorithms rely on (their
binary searches need monotonicity). The real models are the roofline, regression and module-wise
ones in `tidal.perf`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.perf.api import BatchShape

__all__ = ["LinearStepModel"]


@dataclass(frozen=True, slots=True)
class LinearStepModel:
    base_s: float = 0.010  # fixed per-step overhead (kernel launches, sampling), seconds
    per_token_s: float = 1e-5  # per token through the token-wise operators (GEMMs)
    per_ctx_token_s: float = 1e-7  # decode attention, per KV token read
    per_attn_pair_s: float = 1e-9  # prefill attention, per (query, key) pair
    per_decode_req_s: float = 0.0  # extra per decoding request (sampling, bookkeeping)

    def __post_init__(self) -> None:
        coeffs = (
            self.base_s,
            self.per_token_s,
            self.per_ctx_token_s,
            self.per_attn_pair_s,
            self.per_decode_req_s,
        )
        if min(coeffs) < 0:
            raise ValueError("LinearStepModel coefficients must be >= 0 (latency is monotone)")

    def step_s(self, batch: BatchShape) -> float:
        """Predicted step time in seconds."""
        return (
            self.base_s
            + self.per_token_s * (batch.num_prefill_tokens + batch.num_decode_reqs)
            + self.per_decode_req_s * batch.num_decode_reqs
            + self.per_ctx_token_s * batch.decode_context_tokens
            + self.per_attn_pair_s * batch.prefill_attn_pairs
        )


# `--sim-step-model zero` (no time at all) and `linear` (the sim engine's default: about
# SmolLM2-135M on a laptop core)
ZERO_STEP_MODEL = LinearStepModel(0.0, 0.0, 0.0, 0.0, 0.0)
DEFAULT_SIM_STEP_MODEL = LinearStepModel(
    base_s=0.008,
    per_token_s=8e-5,
    per_ctx_token_s=5e-7,
    per_attn_pair_s=0.0,
    per_decode_req_s=1.2e-4,
)
