"""Token sampling (greedy, temperature, top-k, top-p, seeded) and incremental detokenisation with
stop strings cut from the streamed text."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.engine.api import SamplingParams, Tokenizer


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


class Detokenizer:
    """Turns a growing list of output ids into text deltas; cuts at the first stop string and
    holds back any tail that could still become one, so streamed text never contains it."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.emitted = ""  # text already handed out

    def update(self, output_ids: list[int], final: bool) -> tuple[str, bool]:
        """(delta, hit_stop). `final`: the request ends now, flush what is held back."""
        full = self.tokenizer.decode(output_ids)
        if self.stop:
            start = max(0, len(self.emitted) - max(len(s) for s in self.stop))
            hits = [i for s in self.stop if (i := full.find(s, start)) >= 0]
            if hits:
                cut = min(hits)
                delta = full[len(self.emitted) : cut]
                self.emitted += delta
                return delta, True
        end = len(full)
        if not final:
            if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
                end -= 1
            end -= self._held_tail(full[:end])
        delta = full[len(self.emitted) : max(end, len(self.emitted))]
        self.emitted += delta
        return delta, False

    def _held_tail(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
