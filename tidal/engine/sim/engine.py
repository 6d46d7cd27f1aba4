"""The `sim` engine: an emulated `ControllableEngine` for tests, demos and cluster experiments.

It behaves like the torch engine in everything but computing: it takes explicit plans
(`tidal.plan.StepPlan`) or plans itself, holds KV in blocks for the tokens it has computed,
cuts steps at layer boundaries (`request_layer_cut`, the cut chunks resume with `forced_tokens`),
recomputes (`recompute`), swaps KV to host memory, and exports/imports requests with a KV blob
of the real size (`tidal.engine.sim.seq`).
It runs no model: output tokens are deterministic words of the
served model's vocabulary chosen from the prompt (`tidal.engine.sim.tokens`), and each step's
duration comes from a latency model (`tidal.perf.api.StepModel`, default `DEFAULT_SIM_STEP_MODEL`).

With `SimEngineConfig.realtime` the step really waits its emulated time, in `num_layers` equal
parts, so a preemption signal from another thread ends it at the next layer boundary, as in the
torch engine. Its timings are *emulated* (`is_emulated`): the instance service labels every
response and metric accordingly.

Own planner (`step()` with no plan): the torch engine's `FcfsChunkedPlanner`
(`tidal.engine.scheduler`: decodes, then online prefills, then offline ones, each in arrival
order). Entries whose KV does not fit are left out; an online one left out, or nothing
fitting, takes the blocks of the latest offline arrival holding KV (released to its KV
checkpoint when it holds one, `tidal.engine.sim.checkpoint`, else recomputed); online work
is never evicted: with only online holders and nothing fitting, the newest ends with an "out
of KV memory" error event (as in the torch engine).
An explicit plan that does not fit raises MemoryError instead: policies plan with block budgets,
and nothing is changed behind their back.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TextIO

from tidal.engine.api import (
    EngineLoad,
    EngineRequest,
    FinishReason,
    RequestClass,
    SeqSnapshot,
    StepResult,
    StepTelemetry,
    TokenEvent,
    Tokenizer,
    check_fits,
)
from tidal.engine.preemption import LayerPreemption
from tidal.engine.scheduler import SeqView
from tidal.engine.sim.checkpoint import SimCheckpointMixin
from tidal.engine.sim.config import SimEngineConfig
from tidal.engine.sim.migrate import SimMigrateMixin
from tidal.engine.sim.plan import Item, SimOwnPlanMixin, batch_shape, layer_times, tokens_of
from tidal.engine.sim.realtime import RealtimeMixin
from tidal.engine.sim.seq import RUNNING, SWAPPED, WAITING, SimSeq
from tidal.engine.sim.tokens import (
    SimTokenizer,
    cut_at_stop,
    load_sim_tokenizer,
    output_word_ids,
    prompt_key,
    sim_token,
)
from tidal.perf.api import StepModel
from tidal.perf.linear import DEFAULT_SIM_STEP_MODEL, ZERO_STEP_MODEL
from tidal.plan import EngineCapabilities, MigrationMode, PlanRefused, RefusalReason, StepPlan

__all__ = [
    "DEFAULT_SIM_STEP_MODEL",
    "ZERO_STEP_MODEL",
    "SimEngine",
    "SimEngineConfig",
    "SimTokenizer",
    "sim_token",
]


class SimEngine(SimOwnPlanMixin, SimMigrateMixin, RealtimeMixin, SimCheckpointMixin):
    """Implements `tidal.engine.api.ControllableEngine` with emulated step times."""

    name = "sim"
    is_emulated = True

    def __init__(
        self, config: SimEngineConfig | None = None, step_model: StepModel | None = None
    ) -> None:
        self.config = cfg = config or SimEngineConfig()
        self.model_name = cfg.model_name
        self.max_model_len = cfg.max_model_len
        self.block_size = cfg.block_size
        self.num_kv_blocks = cfg.num_kv_blocks
        self.kv_bytes_per_token = float(cfg.kv_bytes_per_token)
        payload = cfg.kv_payload_bytes_per_token
        self.kv_payload_bytes_per_token = cfg.kv_bytes_per_token if payload < 0 else payload
        self.tokenizer: Tokenizer = load_sim_tokenizer(cfg.tokenizer)
        self.word_ids = output_word_ids(self.tokenizer)  # the ids emitted tokens are drawn from
        self.step_model: StepModel = step_model or DEFAULT_SIM_STEP_MODEL
        self.seqs: dict[str, SimSeq] = {}  # insertion order
        self.num_steps = 0
        self.num_recompute_preemptions = 0  # by the own planner, for lack of blocks
        self.last_step_preempted = False
        self.last_preempt_latency_s: float | None = None
        self._free_blocks = cfg.num_kv_blocks
        self._ended = []  # ended out of KV memory by the own planner
        self.preemption = LayerPreemption()
        # Realtime only: `time.perf_counter()` at which the next step's work began (set by the
        # caller before `step`, e.g. the instance loop when it started planning it; used once).
        # The step then ends at origin + its emulated time, so the caller's own work between
        # steps is inside the emulated step instead of added to it: a step takes max(emulated
        # time, actual work), as on an accelerator the host's work overlaps. None: now.
        self.step_origin: float | None = None
        self.last_step_end_s = 0.0  # perf_counter() when the last realtime step ended
        # Realtime only: where each step's wall timings go, one JSON line a step (`trace_step`),
        # for `tidal bench replay` to say where live time went against the emulated time.
        self.step_trace: TextIO | None = None
        self._step_start_s = 0.0  # perf_counter() the running step's emulated time counts from
        self._init_migration()
        self._init_checkpoints()

    # ---- Engine protocol -------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        check_fits(n, request.sampling.max_tokens, self.max_model_len)
        if request.req_id in self.seqs:
            raise ValueError(f"request id {request.req_id!r} is already in this engine")
        prompt = list(request.prompt_token_ids)
        self.seqs[request.req_id] = SimSeq(request, prompt, prompt_key(prompt))
        if self.step_trace is not None:
            self.trace_event("add", request.req_id)

    def abort(self, req_id: str) -> bool:
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return False
        self._release(seq)
        return True

    def has_work(self) -> bool:
        """Anything but swapped-out requests (a released one counts: a step restores it)."""
        return any(s.status != SWAPPED or s.is_released for s in self.seqs.values())

    def load(self) -> EngineLoad:
        seqs = list(self.seqs.values())
        num_online = sum(s.req.req_class == RequestClass.ONLINE for s in seqs)
        num_running = sum(s.status == RUNNING for s in seqs)
        return EngineLoad(
            num_running=num_running,
            num_waiting=len(seqs) - num_running,
            num_kv_blocks_used=self.num_kv_blocks - self._free_blocks,
            num_kv_blocks_total=self.num_kv_blocks,
            num_online=num_online,
            num_offline=len(seqs) - num_online,
        )

    def step(self, plan: StepPlan | None = None) -> StepResult:
        """Run `plan` (its prefill and decode; preempt/swap are the executor's business and are
        ignored; CPU decodes are refused), or the own planner's. ValueError for a plan naming an
        unknown or swapped request or cutting a forced chunk; MemoryError when its KV does not
        fit. Either way nothing has changed."""
        with self.preemption.step():
            own = plan is None
            if plan is None:
                self._resume_released()
                num_tokens = self._own_plan()
            elif plan.cpu_decode or plan.offload or plan.recall:
                raise ValueError("the sim engine has no CPU-attention path (offload/cpu_decode)")
            else:
                num_tokens = tokens_of(plan)
            items = self._prepare(num_tokens)
            if own:
                self._own_checkpoints()
            res = self._run(items)
            ended, self._ended = self._ended, []
            if not ended:
                return res
            return StepResult(events=[*ended, *res.events], telemetry=res.telemetry)

    # ---- ControllableEngine ----------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            layer_cut=True,
            num_layers=self.config.num_layers,
            migration=MigrationMode.KV,
            priority=True,  # the own planner runs online requests first
            kv_checkpoint=self.config.checkpoint_host_bytes > 0,
        )

    def offload(self, req_id: str) -> None:
        raise PlanRefused(RefusalReason.NO_CPU_ATTENTION, "the sim engine has no CPU attention")

    def recall(self, req_id: str) -> None:
        raise PlanRefused(RefusalReason.NO_CPU_ATTENTION, "the sim engine has no CPU attention")

    def wake_step(self) -> None:
        """Nothing to wake: a step here never waits for work."""

    def request_layer_cut(self) -> bool:
        """Thread-safe: end the running step after its current layer; False if none runs."""
        return self.preemption.request()

    def recompute(self, req_id: str) -> None:
        """Preemption by recompute: drop the KV; prompt + output are prefilled again later."""
        seq = self.seqs[req_id]
        if seq.status == SWAPPED:
            raise ValueError(f"{req_id!r} is swapped out; swap it in or abort it")
        self._release(seq)
        seq.num_computed = seq.num_ckpt_tokens = 0

    def swap_out(self, req_id: str) -> None:
        seq = self.seqs[req_id]
        if seq.status != RUNNING:
            raise ValueError(f"{req_id!r} is {seq.status}, only a running request swaps out")
        host = seq.num_kv_tokens
        self._release(seq, keep_partial=True)
        seq.num_host_tokens, seq.status = host, SWAPPED

    def swap_in(self, req_id: str) -> None:
        seq = self.seqs[req_id]
        if seq.status != SWAPPED:
            raise ValueError(f"{req_id!r} is not swapped out")
        self._place(seq, seq.num_host_tokens)
        seq.num_host_tokens = 0
        self._restored(seq)

    def _num_layers(self) -> int:
        return self.config.num_layers

    def snapshot(self) -> list[SeqSnapshot]:
        seqs = sorted(self.seqs.values(), key=lambda s: s.req.arrival_s)
        return [
            dataclasses.replace(
                SeqSnapshot.of(s),
                num_checkpointed_tokens=s.num_ckpt_tokens,
                is_released=s.is_released,
            )
            for s in seqs
        ]

    def num_free_blocks(self) -> int:
        return self._free_blocks

    # ---- beyond the protocol ---------------------------------------------------------------
    def schedulable(self) -> list[SeqView]:
        """What a planner may schedule (swapped-out requests are not shown)."""
        return [SeqView.of(s) for s in self.seqs.values() if s.status != SWAPPED]

    def check_integrity(self) -> None:
        moving = [*self.exporting.values(), *(seq for seq, _ in self.importing.values())]
        held = sum(s.num_blocks for s in [*self.seqs.values(), *moving])
        assert held + self._free_blocks == self.num_kv_blocks, "KV blocks leaked"
        for s in self.seqs.values():
            assert s.num_kv_tokens <= len(s.token_ids), f"{s.req_id}: KV past its tokens"
            if s.status == RUNNING:
                assert s.num_blocks * self.block_size >= s.num_kv_tokens, f"{s.req_id}: KV"
            else:
                assert s.num_blocks == 0, f"{s.req_id}: {s.status} but holds KV blocks"
            host = s.num_kv_tokens if s.status == SWAPPED else 0
            assert s.num_host_tokens == host, f"{s.req_id}: host KV"
        self._check_checkpoints()

    # ---- internals -------------------------------------------------------------------------
    def _blocks_needed(self, seq: SimSeq, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.block_size) - seq.num_blocks)

    def _place(self, seq: SimSeq, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        if need > self._free_blocks:
            raise MemoryError(f"{seq.req_id!r} needs {need} KV blocks, {self._free_blocks} free")
        self._free_blocks -= need
        seq.num_blocks, seq.status = need, RUNNING

    def _release(self, seq: SimSeq, keep_partial: bool = False) -> None:
        self._free_blocks += seq.num_blocks
        seq.num_blocks, seq.num_host_tokens, seq.status = 0, 0, WAITING
        if not keep_partial:
            seq.partial_tokens = seq.partial_layer = 0

    def _prepare(self, num_tokens: dict[str, int]) -> list[Item]:
        """Check the whole plan, then allocate its KV blocks (all or nothing)."""
        items: list[Item] = []
        need = 0
        for rid, n in num_tokens.items():
            seq = self.seqs.get(rid)
            if seq is None or seq.status == SWAPPED:
                raise ValueError(f"plan schedules {rid!r}, which is unknown or swapped out")
            if n < 1:
                raise ValueError(f"plan gives {rid!r} {n} tokens; every entry needs >= 1")
            if seq.partial_tokens and n != seq.partial_tokens:
                raise ValueError(f"{rid!r} must resume its preempted chunk of {seq.partial_tokens}")
            n = min(n, seq.num_pending)
            need += self._blocks_needed(seq, n)
            items.append((seq, n))
        if need > self._free_blocks:
            raise MemoryError(f"the plan needs {need} more KV blocks, {self._free_blocks} free")
        for seq, n in items:
            k = self._blocks_needed(seq, n)
            self._free_blocks -= k
            seq.num_blocks += k
            seq.status = RUNNING
        return items

    def _run(self, items: list[Item]) -> StepResult:
        num_layers = self.config.num_layers
        layer_s = layer_times(items, self.step_model, num_layers)
        first = min((s.partial_layer for s, _ in items), default=num_layers)
        if self.config.realtime:
            called = time.perf_counter()
            done = self._wait_layers(layer_s, first)
            if self.step_trace is not None:
                self.trace_step(called, sum(layer_s[first:done]), items)
        else:
            done = num_layers  # layers run to the end
            for layer in range(first, num_layers - 1):
                if self.preemption.is_set():
                    done = layer + 1
                    break
        step_s = sum(layer_s[first:done])
        shape = batch_shape(items)
        tel = StepTelemetry(
            num_prefill_tokens=shape.num_prefill_tokens,
            num_decode_tokens=shape.num_decode_reqs,
            num_context_tokens=sum(s.num_computed + n for s, n in items),
            num_requests=len(items),
            step_s=step_s,
        )
        self.num_steps += 1
        self.last_step_preempted = done < num_layers
        if self.last_step_preempted:
            self.last_preempt_latency_s = self.preemption.latency_s()
            # OOCO §3.4.1: every chunk that ran keeps the layers it did (decodes too, as in
            # the torch engine's runner) and resumes from `done` with the same token count.
            for seq, n in items:
                if seq.partial_layer < done:
                    seq.partial_tokens, seq.partial_layer = n, done
            return StepResult(events=[], telemetry=tel)
        events: list[TokenEvent] = []
        for seq, n in items:
            seq.num_computed += n
            seq.partial_tokens = seq.partial_layer = 0
            if seq.num_computed == len(seq.token_ids):  # the last token's logits: sample one
                events.append(self._emit(seq))
        for ev in events:
            if ev.finish_reason is not None:
                self._release(self.seqs.pop(ev.req_id))
        return StepResult(events=events, telemetry=tel)

    def _emit(self, seq: SimSeq) -> TokenEvent:
        sp = seq.req.sampling
        tok = sim_token(seq.key, seq.num_output, self.word_ids)
        seq.token_ids.append(tok)
        if self.step_trace is not None and seq.num_output == 1:
            self.trace_event("first", seq.req_id)
        finish: FinishReason | None = None
        delta = ""
        if tok in sp.stop_token_ids:
            finish = FinishReason.STOP  # the stop token itself is not part of the text
        else:
            delta, hit = cut_at_stop(seq.text, self.tokenizer.decode([tok]), sp.stop)
            if hit:
                finish = FinishReason.STOP
            elif seq.num_output >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len:
                finish = FinishReason.LENGTH
        seq.text += delta
        lps: tuple[float, ...] = ()
        tops: tuple[tuple[tuple[int, float], ...], ...] = ()
        if sp.logprobs is not None:
            # The emulated output draws each token uniformly from `word_ids`: that is its
            # distribution, so every word has log(1 / len(word_ids)); the chosen one is listed
            # first among equals.
            lp = -math.log(len(self.word_ids))
            alts = [tok] + [w for w in self.word_ids if w != tok]
            lps, tops = (lp,), (tuple((w, lp) for w in alts[: sp.logprobs]),)
        return TokenEvent(
            req_id=seq.req_id,
            token_ids=(tok,),
            text=delta,
            finish_reason=finish,
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=seq.num_output,
            logprobs=lps,
            top_logprobs=tops,
        )
