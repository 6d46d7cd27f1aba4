"""The question every Tidal decision asks: how long will this batch take?

`BatchShape` is the aggregate description of one engine step that every latency model accepts;
it is built by the simulator, the policies and the `sim` engine alike. Aggregates (not per-request
lists) keep one prediction cheap: the simulator asks it millions of times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BatchShape:
    num_prefill_tokens: int = 0  # new prompt tokens computed this step, summed over requests
    num_prefill_reqs: int = 0  # requests with a prefill chunk in this step
    prefill_attn_pairs: int = 0  # sum over prefill chunks of new * (cached + new): attention work
    num_decode_reqs: int = 0  # requests decoding one token this step
    decode_context_tokens: int = 0  # sum of KV lengths (tokens) over decoding requests
    # sum over prefill chunks of new**2 (OmniServe's causal load c_PA needs it); 0 = unknown,
    # models then assume equal chunks: num_prefill_tokens**2 / num_prefill_reqs
    prefill_sq_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens through the token-wise operators (GEMMs): prefill tokens + one per decode."""
        return self.num_prefill_tokens + self.num_decode_reqs


class StepModel(Protocol):
    """A step-latency model: the roofline, the regression or the module-wise model."""

    def step_s(self, batch: BatchShape) -> float:
        """Predicted wall time of one engine step, in seconds."""
        ...
