"""Executes one step's items on the model: builds the paged-attention batch, runs the layers,
samples, and updates each request (`runner.execute(plan)` of the engine loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tidal.engine.api import FinishReason, TokenEvent
from tidal.engine.torch.attention import AttnMeta, ForwardBatch, PrefillSpan
from tidal.engine.torch.llama import LlamaModel
from tidal.engine.torch.piggyback import Piggyback
from tidal.engine.torch.sampling import apply_penalties, logprobs_of, sample
from tidal.engine.torch.sequence import PartialChunk, Sequence

Item = tuple[Sequence, int]  # (request, tokens this step)


@dataclass
class RunOutput:
    events: list[TokenEvent] = field(default_factory=list)
    done: list[Sequence] = field(default_factory=list)  # items whose chunk completed
    preempted: bool = False
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_context_tokens: int = 0
    # exact regression features tidal.perf.steplog reads when present
    num_prefill_reqs: int = 0
    decode_context_tokens: int = 0  # KV tokens the decodes attend to
    prefill_attn_pairs: int = 0  # Σ new·(cached + new) over prefill chunks
    prefill_sq_tokens: int = 0  # Σ new² over prefill chunks
    num_cpu_decode_tokens: int = 0  # tokens of offloaded requests (attention on CPU workers)


class StepRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv: torch.Tensor,
        block_size: int,
        eos_token_id: int | None,
        max_model_len: int,
    ) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.device = model.device
        self.last_logits: dict[str, torch.Tensor] = {}  # req_id -> logits sampled from (tests)
        self.keep_logits = False

    def run(
        self,
        items: list[Item],
        should_stop: Callable[[], bool],
        module_s: dict[str, float] | None,
        piggy: Piggyback | None = None,
    ) -> RunOutput:
        """Run `items`, and the offloaded rows `piggy` carries (OmniServe §3.2.2) beside them."""
        out = RunOutput()
        if not items and piggy is None:
            return out
        if self.keep_logits:
            self.last_logits = {}

        # Row order: fresh single-token items, fresh chunks, then resumed chunks by start layer,
        # so the rows active at any layer form a prefix (see llama.py).
        def start(it: Item) -> int:
            return it[0].partial.layer if it[0].partial else 0

        items = sorted(items, key=lambda it: (start(it), it[1] > 1))
        for seq, n in items:
            if seq.is_decode:
                out.num_decode_tokens += 1
                out.decode_context_tokens += seq.num_computed + 1
            else:
                out.num_prefill_tokens += n
                out.num_prefill_reqs += 1
                out.prefill_attn_pairs += n * (seq.num_computed + n)
                out.prefill_sq_tokens += n * n
            out.num_context_tokens += seq.num_computed + n
        batch, rows = self._build(items, [start(it) for it in items]) if items else (None, [])
        layers = self.model.forward_layers(batch, self.kv, should_stop, module_s, piggy)
        if layers < self.model.config.num_hidden_layers:
            # OOCO §3.4.1: keep every interrupted chunk's progress; resume from `layers`.
            assert batch is not None or not items
            for (seq, n), (r0, r1) in zip(items, rows, strict=True):
                if start((seq, n)) < layers and batch is not None:
                    seq.partial = PartialChunk(n, layers, batch.hidden[r0:r1].clone())
            out.preempted = True
            return out
        sampled = [
            (seq, r1 - 1)
            for (seq, n), (_, r1) in zip(items, rows, strict=True)
            if seq.num_computed + n == len(seq.token_ids)
        ]
        for seq, n in items:
            seq.num_computed += n
            seq.partial = None
            out.done.append(seq)
        if sampled:
            assert batch is not None
            idx = torch.tensor([r for _, r in sampled], device=self.device)
            self._sample([s for s, _ in sampled], batch.hidden.index_select(0, idx), out)
        if piggy is not None and (fin := piggy.finish()) is not None:
            out.num_cpu_decode_tokens = len(fin[0])
            self._sample(*fin, out)
        return out

    def _sample(self, seqs: list[Sequence], hidden: torch.Tensor, out: RunOutput) -> None:
        """Sample the next token of each of `seqs` from its final hidden state (M, hidden)."""
        logits = self.model.logits(hidden)  # (M, V) fp32
        params = [s.req.sampling for s in seqs]
        chosen_from = logits
        if any(p.is_penalised for p in params):
            chosen_from = apply_penalties(logits, params, [s.output_ids for s in seqs])
        toks, _ = sample(chosen_from, params, [s.generator for s in seqs], False)
        lps: list[float] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        if any(p.logprobs is not None for p in params):
            # NOTE: log-probs under the model, before penalties and bias (as vLLM's default)
            lps, tops = logprobs_of(logits, toks, [p.logprobs or 0 for p in params])
        if self.keep_logits:
            self.last_logits |= {s.req_id: logits[i].cpu() for i, s in enumerate(seqs)}
        for i, seq in enumerate(seqs):
            if seq.req.sampling.logprobs is None:
                out.events.append(self._append(seq, toks[i], None, ()))
            else:
                out.events.append(self._append(seq, toks[i], lps[i], tops[i]))

    def _append(
        self,
        seq: Sequence,
        tok: int,
        logprob: float | None,
        top: tuple[tuple[int, float], ...],
    ) -> TokenEvent:
        sp = seq.req.sampling
        seq.token_ids.append(tok)
        finish: FinishReason | None = None
        end = len(seq.token_ids)  # the output's text: token_ids[num_prompt:end], no copy
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok == self.eos_token_id):
            finish = FinishReason.STOP
            end -= 1
        elif seq.num_output >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len:
            finish = FinishReason.LENGTH
        delta, hit_stop = seq.detok.update(
            seq.token_ids, finish is not None, start=seq.num_prompt, end=end
        )
        if hit_stop:
            finish = FinishReason.STOP
        return TokenEvent(
            req_id=seq.req_id,
            token_ids=(tok,),
            text=delta,
            finish_reason=finish,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=seq.num_output,
            logprobs=() if logprob is None else (logprob,),
            top_logprobs=() if logprob is None else (top,),
        )

    def finish_event(self, seq: Sequence, reason: str, error: str = "") -> TokenEvent:
        delta, _ = seq.detok.update(seq.token_ids, True, start=seq.num_prompt)
        return TokenEvent(
            req_id=seq.req_id,
            token_ids=(),
            text=delta,
            finish_reason=FinishReason(reason),
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=seq.num_output,
            error=error,
        )

    # ---- batch construction ----------------------------------------------------------------
    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        table = torch.tensor(seq.block_ids, dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        return table[pos // bs] * bs + pos % bs

    def _build(
        self, items: list[Item], starts: list[int]
    ) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        rows: list[tuple[int, int]] = []
        r = 0
        for _, n in items:
            rows.append((r, r + n))
            r += n
        fresh = [(s, n) for (s, n), st in zip(items, starts, strict=True) if st == 0]
        hidden_parts: list[torch.Tensor] = []
        if fresh:
            ids = [t for s, n in fresh for t in s.token_ids[s.num_computed : s.num_computed + n]]
            hidden_parts.append(self.model.embed_tokens(torch.tensor(ids, device=self.device)))
        for (s, _), st in zip(items, starts, strict=True):
            if st > 0:
                assert s.partial is not None
                hidden_parts.append(s.partial.hidden)
        hidden = hidden_parts[0] if len(hidden_parts) == 1 else torch.cat(hidden_parts)
        pos_list = [torch.arange(s.num_computed, s.num_computed + n) for s, n in items]
        positions = torch.cat(pos_list) if len(pos_list) > 1 else pos_list[0]
        slot_mapping = torch.cat(
            [self._slots(s, s.num_computed, s.num_computed + n) for s, n in items]
        )
        groups: list[tuple[int, int, AttnMeta]] = []
        for layer in sorted(set(starts)):
            active = [i for i, st in enumerate(starts) if st <= layer]
            groups.append((layer, rows[active[-1]][1], self._meta(items, rows, active)))
        batch = ForwardBatch(
            hidden=hidden.contiguous(),
            positions=positions.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            groups=groups,
        )
        return batch, rows

    def _meta(self, items: list[Item], rows: list[tuple[int, int]], active: list[int]) -> AttnMeta:
        bs, dev = self.block_size, self.device
        single = [i for i in active if items[i][1] == 1]
        meta = AttnMeta(decode_rows=slice(0, 0), decode_slots=None, decode_bias=None)
        if single:
            srows = [rows[i][0] for i in single]
            meta.decode_rows = (
                slice(0, len(srows))
                if srows == list(range(len(srows)))
                else torch.tensor(srows, device=dev)
            )
            if len(single) == 1 and (span := _span(items[single[0]][0], bs)) is not None:
                meta.decode_span = span  # attention reads the cache in place
                single = []
        if single:
            ctx = torch.tensor([items[i][0].num_computed + 1 for i in single])  # (B,)
            nblk = max(len(items[i][0].block_ids) for i in single)
            table = torch.zeros(len(single), nblk, dtype=torch.int64)
            for j, i in enumerate(single):
                b = items[i][0].block_ids
                table[j, : len(b)] = torch.tensor(b)
            T = int(ctx.max())
            pos = torch.arange(T)
            slots = table[:, pos // bs] * bs + pos % bs  # (B, T)
            pad = pos[None, :] >= ctx[:, None]  # (B, T) past a shorter context
            # NOTE: padded positions read the request's own first slot, never an unwritten one:
            # the KV pool is torch.empty, and garbage there (inf/NaN) would survive the -inf
            # bias (inf - inf, 0 * NaN) and poison the whole row.
            slots = torch.where(pad, slots[:, :1], slots)
            Hk = self.model.config.num_key_value_heads
            kv_rows = slots[:, None, :] * Hk + torch.arange(Hk)[None, :, None]  # (B, Hk, T)
            meta.decode_slots = slots.to(dev)
            meta.decode_kv_rows = kv_rows.reshape(-1).to(dev)
            meta.decode_lens = ctx
            if bool(pad.any()):
                bias = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))
                meta.decode_bias = bias.to(dev, self.model.dtype)[:, None, None, :]
        for i in active:
            seq, n = items[i]
            if n == 1:
                continue
            nc = seq.num_computed
            T = nc + n
            q_pos = torch.arange(nc, T)
            mask = torch.arange(T)[None, :] <= q_pos[:, None]  # (n, T) causal, bottom-right
            meta.prefills.append(
                PrefillSpan(
                    row_start=rows[i][0],
                    row_end=rows[i][1],
                    ctx_slots=self._slots(seq, 0, T).to(dev),
                    mask=None if nc == 0 else mask.to(dev),
                )
            )
        return meta


def _span(seq: Sequence, bs: int) -> tuple[int, int] | None:
    """(first slot, context length) when a decode's context lies in consecutive blocks."""
    T = seq.num_computed + 1
    b = seq.block_ids[: -(-T // bs)]
    return (b[0] * bs, T) if b == list(range(b[0], b[0] + len(b))) else None
