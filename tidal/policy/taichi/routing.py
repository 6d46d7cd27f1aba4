"""TaiChi length-aware prefill scheduling in the proxy (papers/taichi.md §3.4, Alg. 2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.perf.api import BatchShape, StepModel
from tidal.policy.batch_shape import add_prefill


@dataclass(frozen=True, slots=True)
class PrefillTarget:
    """An instance as Alg. 2 sees it."""

    instance_id: int
    is_p_heavy: bool  # P-heavy pays the KV transfer to its D-heavy decode instance (line 5)
    chunk_tokens: int  # its chunk size (S_p or S_d)
    queued_tokens: Sequence[int]  # prefill tokens left per queued request, FCFS order
    decode: BatchShape  # decodes it runs beside every chunk ("i.batch")
    model: StepModel
    max_reqs: int = 0  # most requests in one step (vLLM's max_num_seqs); 0: no cap

    @property
    def can_prefill(self) -> bool:
        """A step here has room for a prompt beside its decodes: chunk tokens and a request
        slot (decodes at the slot cap prefill nothing, as in a budget full of decodes)."""
        n = self.decode.num_decode_reqs
        return self.chunk_tokens > n and (self.max_reqs <= 0 or self.max_reqs > n)


def estimate_prefill_s(
    model: StepModel, tokens: int, chunk: int, decode: BatchShape, cached: int = 0
) -> float:
    """Estimate(len, chunk, batch): seconds to prefill `tokens` beside the decode batch. The chunk
    is a per-step token budget that the batch's decodes draw on first (Sarathi-Serve / vLLM
    chunked prefill, on which TaiChi runs, §3.5), so each step prefills `chunk - decodes`
    tokens; a batch that fills the budget never prefills (infinite). Full chunks are charged at
    the mean cached length, which is exact for latency models linear in attention pairs and
    costs two model calls instead of one per chunk."""
    if tokens <= 0:
        return 0.0
    chunk -= decode.num_decode_reqs
    if chunk <= 0:
        return math.inf
    n_full, rest = divmod(tokens, chunk)
    total = 0.0
    if n_full:
        mid_cached = cached + (n_full - 1) * chunk // 2
        total += n_full * model.step_s(add_prefill(decode, chunk, mid_cached))
    if rest:
        total += model.step_s(add_prefill(decode, rest, cached + n_full * chunk))
    return total


def queue_lower_bound_s(
    model: StepModel, queued_tokens: Sequence[int], chunk: int, decode: BatchShape
) -> float:
    """A cheap lower bound on the sum of `estimate_prefill_s` over a queue, in at most two model
    calls: every full chunk costs at least the chunk with nothing cached, every partial chunk at
    least the decode batch alone. Valid for step models that never get faster with more prefill
    tokens or a longer cached prefix (the roofline and the fitted linear models)."""
    eff = chunk - decode.num_decode_reqs
    if eff <= 0:
        return math.inf if any(n > 0 for n in queued_tokens) else 0.0
    full = partial = 0
    for n in queued_tokens:
        if n > 0:
            q, r = divmod(n, eff)
            full += q
            partial += r > 0
    bound = 0.0
    if full:
        bound += full * model.step_s(add_prefill(decode, eff, 0))
    if partial:
        bound += partial * model.step_s(decode)
    return bound


def route_prefill(
    prompt_tokens: int,
    targets: Sequence[PrefillTarget],
    ttft_slo_s: float,
    transfer_s: float,
    waited_s: float = 0.0,
) -> int | None:
    """TaiChi Alg. 2: the feasible instance (Q + E + T < TTFT SLO) with the fewest queued prefill
    tokens, or None when no instance is feasible (lines 13-15). `transfer_s` is the KV transfer
    time of this request (line 5, P-heavy only); `waited_s` is time it has already spent."""
    budget = ttft_slo_s - waited_s
    # Line 11 takes the feasible instance with the fewest queued prefill tokens, so visit them
    # in that order and stop at the first feasible one: same answer, fewer model calls. Each
    # queue estimate stops as soon as it alone breaks the budget (line 6 cannot hold then).
    for _, t in sorted(((sum(t.queued_tokens), t.instance_id), t) for t in targets):
        if not t.can_prefill:
            continue
        tt = transfer_s if t.is_p_heavy else 0.0
        e = estimate_prefill_s(t.model, prompt_tokens, t.chunk_tokens, t.decode)
        if e + tt >= budget:
            continue
        # A queue whose lower bound already breaks the budget is infeasible without estimating
        # each request (the usual case when every instance is busy; same answer, fewer calls).
        if e + tt + queue_lower_bound_s(t.model, t.queued_tokens, t.chunk_tokens, t.decode) >= (
            budget
        ):
            continue
        q = 0.0
        for n in t.queued_tokens:
            if q + e + tt >= budget:
                break
            q += estimate_prefill_s(t.model, n, t.chunk_tokens, t.decode)
        if q + e + tt < budget:  # line 6: Q + E + T < TTFT SLO
            return t.instance_id
    return None  # lines 13-15: no instance is feasible
