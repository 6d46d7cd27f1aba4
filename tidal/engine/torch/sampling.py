"""Token sampling (greedy, temperature, top-k, top-p, seeded; OpenAI's frequency and presence
penalties and logit_bias; log-probs with top alternatives). `Detokenizer` (incremental
detokenisation, stop strings cut) lives in `tidal.engine.detokenizer` and is re-exported here."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.engine.api import SamplingParams
from tidal.engine.detokenizer import Detokenizer

__all__ = ["Detokenizer", "apply_penalties", "logprobs_of", "make_generator", "sample"]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator(device="cpu")
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    want_logprobs: bool,
) -> tuple[list[int], list[float]]:
    """logits (M, V) fp32 -> one token per row, and its log-prob under the model when asked."""
    tokens = logits.argmax(dim=-1).tolist()  # greedy for all rows in one op
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        row = logits[i].to("cpu", torch.float32) / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token once the mass before it already reaches top_p
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            row = row.scatter(0, idx, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    logprobs: list[float] = []
    if want_logprobs:
        lp = torch.log_softmax(logits.float(), dim=-1)
        logprobs = (
            lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        )
    return tokens, logprobs


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """logits (M, V) with each row's OpenAI penalties and logit_bias applied (a new tensor):
    logit -= frequency_penalty * count + presence_penalty * (count > 0), count being how often
    the token is in that row's output so far; then logit_bias is added."""
    out = logits.float().clone()
    vocab = out.shape[1]
    for i, p in enumerate(params):
        if not p.is_penalised:
            continue
        if (p.frequency_penalty or p.presence_penalty) and outputs[i]:
            ids = torch.tensor(list(outputs[i]), device=out.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(out.dtype)  # (V,)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
        for tid, bias in p.logit_bias:
            out[i, int(tid)] += float(bias)
    return out


def logprobs_of(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int]
) -> tuple[list[float], list[tuple[tuple[int, float], ...]]]:
    """Each row's chosen token's log-prob under `logits` (M, V), and its `num_top[i]` most
    likely (token id, log-prob) pairs, most likely first; tied ones by token id, the order in
    which greedy sampling (`argmax`: the first of equal maxima) chooses among them, so a greedy
    token is its own first alternative. Logits rounded to bf16 tie often."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (M, V)
    chosen = lp.gather(1, torch.tensor(list(tokens), device=lp.device).unsqueeze(1)).squeeze(1)
    k = max(num_top, default=0)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if k:
        values, ids = torch.topk(lp, k, dim=-1)  # (M, k)
        vals, idl = values.tolist(), ids.tolist()
        tops = [
            tuple(sorted(zip(idl[i], vals[i], strict=True), key=_by_logprob)[: num_top[i]])
            for i in range(len(tokens))
        ]
    return chosen.tolist(), tops


def _by_logprob(pair: tuple[int, float]) -> tuple[float, int]:
    """Most likely first, ties by token id (`torch.topk` leaves ties in no set order)."""
    return -pair[1], pair[0]
