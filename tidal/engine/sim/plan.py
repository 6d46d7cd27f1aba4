"""Step planning and timing of the `sim` engine: its own online-first planner (and how it makes
room: offline work only is evicted), the batch shape of a step, and the emulated time of each
layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tidal.engine.api import OUT_OF_KV_ERROR, FinishReason, TokenEvent
from tidal.engine.scheduler import FcfsChunkedPlanner, SeqView
from tidal.engine.sim.config import SimEngineConfig
from tidal.engine.sim.seq import SimSeq
from tidal.perf.api import BatchShape, StepModel
from tidal.schemas.enums import RequestClass

__all__ = [
    "Item",
    "SimOwnPlanMixin",
    "batch_shape",
    "layer_times",
    "tokens_of",
]

Item = tuple[SimSeq, int]  # (request, tokens this step)


def tokens_of(plan: Any) -> dict[str, int]:
    """req_id -> tokens this step, from a `tidal.plan.StepPlan` (or any plan with
    `num_tokens`); a decode computes 1."""
    num_tokens = getattr(plan, "num_tokens", None)
    if num_tokens is None:
        num_tokens = dict(plan.prefill) | dict.fromkeys(plan.decode, 1)
    return dict(num_tokens)


def batch_shape(items: Sequence[Item]) -> BatchShape:
    p = pr = pairs = sq = d = ctx = 0
    for seq, n in items:
        if seq.is_decode:
            d += 1
            ctx += seq.num_computed + 1
        else:
            p, pr, pairs, sq = p + n, pr + 1, pairs + n * (seq.num_computed + n), sq + n * n
    return BatchShape(
        num_prefill_tokens=p,
        num_prefill_reqs=pr,
        prefill_attn_pairs=pairs,
        num_decode_reqs=d,
        decode_context_tokens=ctx,
        prefill_sq_tokens=sq,
    )


def layer_times(items: Sequence[Item], step_model: StepModel, num_layers: int) -> list[float]:
    """Emulated seconds of each layer: layer l runs the chunks that start at or before it (a
    chunk cut by a preemption resumes at `partial_layer`), so a resumed chunk only costs its
    remaining layers' share of the step time. An empty step takes 0 s."""
    out = [0.0] * num_layers
    starts = sorted({s.partial_layer for s, _ in items})
    for i, start in enumerate(starts):
        active = [(s, n) for s, n in items if s.partial_layer <= start]
        end = starts[i + 1] if i + 1 < len(starts) else num_layers
        out[start:end] = [step_model.step_s(batch_shape(active)) / num_layers] * (end - start)
    return out


class SimOwnPlanMixin:
    """The sim engine's own plan, made to fit its free KV blocks."""

    config: SimEngineConfig
    seqs: dict[str, SimSeq]
    block_size: int
    num_recompute_preemptions: int
    _free_blocks: int
    _ended: list[TokenEvent]

    def schedulable(self) -> list[SeqView]:
        raise NotImplementedError

    def recompute(self, req_id: str) -> None:
        raise NotImplementedError

    def _blocks_needed(self, seq: SimSeq, n: int) -> int:
        raise NotImplementedError

    def _release(self, seq: SimSeq, keep_partial: bool = False) -> None:
        raise NotImplementedError

    if TYPE_CHECKING:

        def _evict_offline(self, seq: SimSeq) -> None: ...

    def _own_plan(self) -> dict[str, int]:
        """The online-first plan, made to fit: an online entry left out for lack of blocks
        takes them from offline holders (latest arrival first: released to its checkpoint when
        it holds one, else recomputed); when nothing fits
        and no offline request holds KV, the newest online holder ends out of KV memory
        (`self._ended`). Online work is never evicted."""
        cfg = self.config
        while True:
            # the torch engine's planner (decodes, then online prefills, then offline ones)
            planner = FcfsChunkedPlanner(cfg.max_batch_tokens, cfg.chunk_size, cfg.max_num_seqs)
            want = tokens_of(planner.plan(self.schedulable(), self._free_blocks, self.block_size))
            fitted: dict[str, int] = {}
            free = self._free_blocks
            for rid, n in want.items():
                seq = self.seqs[rid]
                need = self._blocks_needed(seq, min(n, seq.num_pending))
                if need <= free:
                    fitted[rid] = n
                    free -= need
            left = [self.seqs[rid] for rid in want if rid not in fitted]
            online_left = any(s.req.req_class is RequestClass.ONLINE for s in left)
            if not left or (fitted and not online_left):
                return fitted
            offline = [s for s in self.seqs.values() if s.num_blocks and not _online(s)]
            if offline:  # the latest offline arrival holding KV: released or recomputed
                self._evict_offline(max(offline, key=lambda s: s.req.arrival_s))
                continue
            online = [s for s in self.seqs.values() if s.num_blocks and _online(s)]
            if fitted or not online or not online_left:
                return fitted  # the left-out ones wait for room
            victim = max(online, key=lambda s: s.req.arrival_s)
            self._ended.append(self._end_no_kv(victim))

    def _end_no_kv(self, seq: SimSeq) -> TokenEvent:
        self._release(self.seqs.pop(seq.req_id))
        return TokenEvent(
            req_id=seq.req_id,
            token_ids=(),
            text="",
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=seq.num_output,
            error=OUT_OF_KV_ERROR,
        )


def _online(seq: SimSeq) -> bool:
    return seq.req.req_class is RequestClass.ONLINE
