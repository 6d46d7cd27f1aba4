"""`torch`: the real instance engine, a paged-KV PyTorch engine for the Llama family.

Implements `tidal.engine.api.Engine` (add / abort / has_work / step / load). Beyond it, the
instance service may call:

- `request_layer_cut() -> bool` — thread-safe, from any thread while `step()` runs in another: the
  step stops after the current transformer layer and returns with no events. Each interrupted
  chunk keeps its hidden states and the KV of the layers already run, and a later step resumes it
  from that layer without recompute (OOCO §3.4.1). `last_preempt_latency_s` is the measured
  signal-to-free time; `last_step_preempted` says the last step was cut short.
- `step(plan: StepPlan | None = None)` — run an explicit plan (req_id -> tokens this step);
  without one, `self.planner` (default `FcfsChunkedPlanner`: decodes, then prefill chunks,
  online first, under a token budget) decides. Out of KV, only offline work is evicted
  (`tidal.engine.torch.kv`). `set_planner()` swaps it (TaiChi chunk sizes, HyGen budgets).
  `schedulable()` lists what a planner may schedule.
- `begin_export`/`end_export`/`begin_import`/`end_import` (`tidal.engine.migrate`) — a
  request's tokens, sampling state (RNG included) and KV of all layers, chunk by chunk, so
  another engine continues it with identical output (push/pull migration).
- `swap_out(req_id)` / `swap_in(req_id)` — move a request's KV to host memory and back.
- `checkpoint(req_id)` / `release(req_id)` (`tidal.engine.torch.checkpoint`, with
  `EngineConfig.checkpoint_host_bytes`) — offline KV saved to host memory block by block, in
  the background beside the next step, and a preemption that frees the GPU blocks at once;
  `swap_in` restores a released request; `wait_checkpoints()` waits for the copies queued.
  With no plan, the engine checkpoints its running offline requests itself, its own eviction
  releases the checkpointed ones, and it restores them when KV allows.
- `free_kv_tokens()`, `check_integrity()`.

Per-step `StepTelemetry` is in every `StepResult`; with `EngineConfig.step_log` each completed
step is also appended as one JSON line: the `StepTelemetry` field names, plus the optional exact
features `tidal.perf.steplog` reads (`num_prefill_reqs`, `decode_context_tokens`,
`prefill_attn_pairs`, `prefill_sq_tokens`). Preempted steps are not logged.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TextIO

import torch

from tidal.engine.api import (
    OUT_OF_KV_ERROR,
    EngineLoad,
    EngineRequest,
    RequestClass,
    SeqSnapshot,
    StepResult,
    StepTelemetry,
)
from tidal.engine.preemption import LayerPreemption
from tidal.engine.scheduler import FcfsChunkedPlanner, SeqView, StepPlanner
from tidal.engine.tokenizer import TidalTokenizer
from tidal.engine.torch import kv_transfer as kvt
from tidal.engine.torch.checkpoint import TorchCheckpointMixin
from tidal.engine.torch.core_share import CoreShare
from tidal.engine.torch.cpu_offload import CpuOffloadMixin
from tidal.engine.torch.dtype_choice import DtypeChoice
from tidal.engine.torch.engine_config import EngineConfig, default_dtype
from tidal.engine.torch.kv import TorchKvMixin
from tidal.engine.torch.kv_cache import BlockAllocator
from tidal.engine.torch.llama import LlamaModel
from tidal.engine.torch.migrate import TorchMigrateMixin
from tidal.engine.torch.model_config import ModelConfig
from tidal.engine.torch.runner import StepRunner
from tidal.engine.torch.sampling import Detokenizer, make_generator
from tidal.engine.torch.sequence import SeqStatus, Sequence
from tidal.plan import EngineCapabilities, MigrationMode, StepPlan

__all__ = ["EngineConfig", "TorchEngine", "default_dtype"]

_DECODING = (SeqStatus.RUNNING, SeqStatus.OFFLOADED)  # counted as running in `load()`


class TorchEngine(TorchKvMixin, CpuOffloadMixin, TorchMigrateMixin, TorchCheckpointMixin):
    name = "torch"
    is_emulated = False

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: TidalTokenizer,
        model_name: str,
        config: EngineConfig | None = None,
        planner: StepPlanner | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.dtype_choice: DtypeChoice | None = None  # set by load_torch_engine when it chose
        # cores shared with the other engines on this machine: threads follow who is busy
        self.core_share: CoreShare | None = None
        self.num_threads = 0  # no core share: torch threads of every stepping thread (0: as is)
        mc: ModelConfig = model.config
        num_blocks = cfg.kv_cache_tokens // cfg.block_size
        self.block_size = cfg.block_size
        self.num_kv_blocks = num_blocks
        # k and v of every layer, in the model's dtype
        self.kv_bytes_per_token = float(
            mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * model.dtype.itemsize
        )
        self.allocator = BlockAllocator(num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        # (L, 2, slots, Hk, D); torch.empty so the OS commits pages only as they are used
        self.kv = torch.empty(
            (
                mc.num_hidden_layers,
                2,
                num_blocks * cfg.block_size,
                mc.num_key_value_heads,
                mc.head_dim,
            ),
            dtype=model.dtype,
            device=model.device,
        )
        self.max_model_len = min(
            cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        if mc.sliding_window:  # full attention is exact only within the window
            self.max_model_len = min(self.max_model_len, mc.sliding_window)
        # a request may hold no more than the KV pool (the worker sizes a default max_tokens
        # by this, so such a request is never refused at `add` for want of KV)
        self.max_model_len = min(self.max_model_len, num_blocks * cfg.block_size)
        self.planner: StepPlanner = planner or FcfsChunkedPlanner(
            cfg.token_budget, cfg.chunk_size, cfg.max_num_seqs
        )
        self.runner = StepRunner(
            model, self.kv, cfg.block_size, tokenizer.eos_token_id, self.max_model_len
        )
        self.seqs: dict[str, Sequence] = {}  # insertion order = arrival order
        self.preemption = LayerPreemption()
        self.last_step_preempted = False
        self.last_preempt_latency_s: float | None = None
        self.num_recompute_preemptions = 0  # requests that lost their KV to memory pressure
        self.num_recompute_lost_tokens = 0  # the KV tokens they dropped, to compute again
        self._last_step_s = 0.0
        self._init_migration()
        self._init_checkpoints()
        self._log: TextIO | None = None
        if cfg.step_log:
            Path(cfg.step_log).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(cfg.step_log, "a")  # noqa: SIM115 - lives as long as the engine

    # ---- Engine protocol -------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        if request.req_id in self.seqs:
            raise ValueError(f"request id {request.req_id!r} is already in this engine")
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens leaves no room under max_model_len {self.max_model_len}"
            )
        # (as `check_fits` counts the context: the KV pool caps `max_model_len`)
        if n + request.sampling.max_tokens > self.allocator.num_blocks * self.block_size:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({request.sampling.max_tokens}) can never fit "
                f"this instance's KV cache of {self.allocator.num_blocks * self.block_size} tokens"
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt holds token ids outside [0, {vocab})")
        sp = request.sampling
        sp.check_vocab(vocab)
        self.seqs[request.req_id] = Sequence(
            req=request,
            token_ids=list(request.prompt_token_ids),
            num_prompt=n,
            detok=Detokenizer(self.tokenizer, sp.stop),
            generator=make_generator(sp),
        )

    def abort(self, req_id: str) -> bool:
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return False
        self._free(seq)
        if self.core_share is not None and not self.has_work():
            self.core_share.idle()  # the last request left (aborted, migrated): free the cores
        return True

    def has_work(self) -> bool:
        """Anything but swapped-out requests (a released one counts: a step restores it)."""
        return any(
            s.status != SeqStatus.SWAPPED or s.swapped_kv is None for s in self.seqs.values()
        )

    def load(self) -> EngineLoad:
        seqs = list(self.seqs.values())
        return EngineLoad(
            num_running=sum(s.status in _DECODING for s in seqs),
            num_waiting=sum(s.status not in _DECODING for s in seqs),
            num_kv_blocks_used=self.allocator.num_used,
            num_kv_blocks_total=self.allocator.num_blocks,
            num_online=sum(s.req.req_class == RequestClass.ONLINE for s in seqs),
            num_offline=sum(s.req.req_class == RequestClass.OFFLINE for s in seqs),
        )

    def step(self, plan: StepPlan | None = None) -> StepResult:
        t0 = time.perf_counter()
        if self.core_share is not None:
            self.core_share.apply(self._last_step_s)
        elif self.num_threads and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)  # per thread under OpenMP (CoreShare.apply)
        try:
            return self._step(plan, t0)
        finally:
            self._last_step_s = time.perf_counter() - t0
            if self.core_share is not None:  # renew the stamp past a long step, or free it
                if self.has_work():
                    self.core_share.busy(self._last_step_s)
                else:
                    self.core_share.idle()

    def _step(self, plan: StepPlan | None, t0: float) -> StepResult:
        with self.preemption.step():
            self._harvest_checkpoints()
            own = plan is None
            if plan is None:
                self._resume_released()
                plan = self.planner.plan(
                    self.schedulable(), self.allocator.num_free, self.block_size
                )
            self._requeue_lost()
            items, ended = self._prepare(plan)
            if own:  # queued now, copied while this step computes
                self._own_checkpoints()
            events = [self.runner.finish_event(s, "error", OUT_OF_KV_ERROR) for s in ended]
            module_s: dict[str, float] | None = {} if self.config.profile_modules else None
            piggy = self._piggyback(plan.cpu_decode, not items, self.preemption.is_set)
            out = self.runner.run(items, self.preemption.is_set, module_s, piggy)
            if piggy is not None:
                self.piggy_steps.append((len(piggy.seqs), piggy.overhead_s))
            self.last_step_preempted = out.preempted
            if out.preempted:
                self.last_preempt_latency_s = self.preemption.latency_s()
            for seq in out.done:
                self._register_blocks(seq)
            for ev in out.events:
                events.append(ev)
                if ev.finish_reason is not None:
                    self._free(self.seqs.pop(ev.req_id))
            tel = StepTelemetry(
                num_prefill_tokens=out.num_prefill_tokens,
                num_decode_tokens=out.num_decode_tokens,
                num_context_tokens=out.num_context_tokens,
                num_requests=len(items),
                step_s=time.perf_counter() - t0,
                module_s=module_s or {},
            )
            if self._log is not None and items and not out.preempted:
                extra = {
                    "num_prefill_reqs": out.num_prefill_reqs,
                    "decode_context_tokens": out.decode_context_tokens,
                    "prefill_attn_pairs": out.prefill_attn_pairs,
                    "prefill_sq_tokens": out.prefill_sq_tokens,
                }
                self._log.write(json.dumps(dataclasses.asdict(tel) | extra) + "\n")
                self._log.flush()
            return StepResult(events=events, telemetry=tel)

    # ---- control beyond the protocol -------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        cfg_ckpt = self.config.checkpoint_host_bytes
        return EngineCapabilities(
            layer_cut=True,
            num_layers=self.model.config.num_hidden_layers,
            migration=MigrationMode.KV,
            cpu_attention=self.cpu_link is not None,
            priority=True,  # the own planner runs online requests first
            kv_checkpoint=cfg_ckpt > 0,
        )

    def wake_step(self) -> None:
        """Nothing to wake: a step here never waits for work."""

    def request_layer_cut(self) -> bool:
        """Stop the running step after its current layer; False if no step is running."""
        return self.preemption.request()

    def set_planner(self, planner: StepPlanner) -> None:
        self.planner = planner

    def schedulable(self) -> list[SeqView]:
        return [
            SeqView.of(s)
            for s in self.seqs.values()
            if s.status not in (SeqStatus.SWAPPED, SeqStatus.OFFLOADED)
        ]

    def snapshot(self) -> list[SeqSnapshot]:
        self._requeue_lost()  # the policy plans with what the workers still hold
        self._harvest_checkpoints()
        return [self._snapshot_of(s) for s in self.seqs.values()]

    @staticmethod
    def _snapshot_of(seq: Sequence) -> SeqSnapshot:
        """Checkpointed tokens as queued (copied or being copied: what the host budget holds,
        and what a release keeps unless a copy had not started; `checkpoint.release`)."""
        snap = SeqSnapshot.of(seq)
        released = seq.status == SeqStatus.SWAPPED and seq.swapped_kv is None
        if not seq.num_ckpt_queued and not released:
            return snap
        return dataclasses.replace(
            snap, num_checkpointed_tokens=seq.num_ckpt_queued, is_released=released
        )

    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def recompute(self, req_id: str) -> None:
        """Preemption by recompute: drop the request's KV; it prefills prompt + output again."""
        seq = self.seqs[req_id]
        if seq.status == SeqStatus.SWAPPED:
            raise ValueError(f"{req_id!r} is swapped out; swap it in or abort it")
        if seq.status == SeqStatus.OFFLOADED:
            self._drop_offloaded(seq)
            seq.num_computed, seq.hashes, seq.status = 0, [], SeqStatus.WAITING
            self.num_recompute_preemptions += 1
        if seq.block_ids:
            self._preempt_recompute(seq)
        self._drop_checkpoint(seq)

    def free_kv_tokens(self) -> int:
        return self.allocator.num_free * self.block_size

    def check_integrity(self) -> None:
        moving = [*self.exporting.values(), *(seq for seq, _ in self.importing.values())]
        self.allocator.check_integrity([s.block_ids for s in [*self.seqs.values(), *moving]])
        for s in self.seqs.values():
            if s.status != SeqStatus.RUNNING:
                assert not s.block_ids, f"{s.req_id}: {s.status} but holds KV blocks"
            held = self._kv_tokens(s)
            if s.status == SeqStatus.RUNNING:
                assert len(s.block_ids) * self.block_size >= held, f"{s.req_id}: KV past blocks"
            if s.status == SeqStatus.SWAPPED and s.swapped_kv is not None:
                assert s.swapped_kv.shape[2] == held, f"{s.req_id}: swapped KV of another size"
        self._check_checkpoints()

    # ---- KV movement -----------------------------------------------------------------------
    def swap_out(self, req_id: str) -> None:
        seq = self.seqs[req_id]
        if seq.status != SeqStatus.RUNNING:
            raise ValueError(f"{req_id!r} is {seq.status}, only a running request swaps out")
        slots = kvt.token_slots(seq.block_ids, 0, self._kv_tokens(seq), self.block_size)
        seq.swapped_kv = kvt.gather_kv(self.kv, slots)
        if seq.partial is not None:
            seq.partial.hidden = seq.partial.hidden.to("cpu")
        self._release_blocks(seq)
        seq.status = SeqStatus.SWAPPED

    def swap_in(self, req_id: str) -> None:
        seq = self.seqs[req_id]
        if seq.status != SeqStatus.SWAPPED:
            raise ValueError(f"{req_id!r} is not swapped out")
        if seq.swapped_kv is None:  # released to its checkpoint
            self._restore(seq)
            return
        self._place_kv(seq, seq.swapped_kv)
        seq.swapped_kv = None
        if seq.partial is not None:
            seq.partial.hidden = seq.partial.hidden.to(self.model.device)

    def _place_kv(self, seq: Sequence, kv: torch.Tensor) -> None:
        n = kv.shape[2]
        need = -(-n // self.block_size)
        if not self.allocator.can_allocate(need):
            raise MemoryError(
                f"{seq.req_id!r} needs {need} KV blocks, {self.allocator.num_free} free"
            )
        seq.block_ids = self.allocator.allocate(need)
        kvt.scatter_kv(self.kv, kvt.token_slots(seq.block_ids, 0, n, self.block_size), kv)
        seq.status = SeqStatus.RUNNING
        seq.num_registered = 0  # fresh blocks: register them again after the next step
        self._register_blocks(seq)

    # ---- scheduling internals --------------------------------------------------------------
    def _register_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        full = seq.num_computed // bs
        while len(seq.hashes) < full:
            b = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else 0
            seq.hashes.append(hash((parent, tuple(seq.token_ids[b * bs : (b + 1) * bs]))))
        for b in range(seq.num_registered, full):
            self.allocator.register(seq.block_ids[b], seq.hashes[b])
        seq.num_registered = max(seq.num_registered, full)

    def _free(self, seq: Sequence) -> None:
        self._drop_offloaded(seq)
        self._drop_checkpoint(seq)
        if seq.block_ids:
            self._release_blocks(seq)
        seq.swapped_kv = None
        seq.partial = None
