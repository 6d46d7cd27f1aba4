"""`StepPlan`: one step of one instance, as a policy decides it and an engine carries it out.

The contract (the page for people is `docs/plan-contract.md`)
=============================================================
A `StepPlan` belongs to neither side: policies (`tidal.policy`) build it, the simulator
(`tidal.sim`) and the live engines (`tidal.engine`) carry it out, all through one interpreter
(`tidal.plan.interpreter.carry_out`). Every field is carried out as written below, or the whole
plan is refused with a typed `PlanRefused` (`tidal.plan.errors`) naming a `RefusalReason`; the
live instance logs and counts each refusal (`tidal_plan_refusals_total{reason=...}`). No field
is ever silently dropped.

Stages run in this order; a request may appear in at most one list of a plan:

0. ``abort_no_kv`` req_ids (online ones included) that cannot get KV memory while no offline
                   work is left to evict: they end with finish_reason "error" and the message
                   "out of KV memory" (simulator: rejected, reason "out_of_kv").  all engines
0b. ``checkpoint`` running offline req_ids: copy to host memory the full KV blocks not yet
                   saved (ConServe's incremental checkpoint); the request keeps running. Refused
                   `host_memory_full` past the engine's checkpoint budget.  `kv_checkpoint` only
1. ``recompute``   running/offloaded req_ids lose their KV, wait at the head of the queue and
                   prefill prompt + output again later.                       all engines
1b. ``release``    running offline req_ids holding a checkpoint: their GPU blocks are freed at
                   once, with no copy; they wait swapped with the checkpointed blocks as their KV.
                   The tokens past the last checkpointed block are lost and prefilled again after
                   ``swap_in`` (which, for them, copies back the checkpoint).  `kv_checkpoint` only
2. ``swap_out``    running req_ids: KV to host memory, paused (an engine that cannot move KV
                   declares ``swap_is_recompute`` and recomputes instead).     all engines
3. ``offload``     running, decoding req_ids: KV to host, decode attention on CPU workers
                   (OmniServe §3.2).                                     `cpu_attention` only
4. ``swap_in``     swapped req_ids: KV back to the GPU (a released request: its checkpointed
                   blocks, the restore; its lost tail is then prefilled).      all engines
5. ``recall``      offloaded req_ids: KV back to the GPU.                 `cpu_attention` only
6. one step over ``prefill`` (req_id -> tokens), ``decode`` (one token each, GPU attention)
   and ``cpu_decode`` (one token each, attention on CPU workers; `cpu_attention` only),
   repeated up to ``max_repeat`` times when the plan is decode-only, and cut at a layer
   boundary when ``layer_cut`` is set and an online request arrives.

Eviction by class: ``recompute``, ``release``, ``swap_out`` and ``offload`` may name any
offline request (``checkpoint`` too). ``recompute``, ``release`` and ``swap_out`` may name an
online request only of a lower priority (its request class's) than an online request on the
instance (waiting for room, or running and short of KV for its next step), or than
``evict_below`` (the preempt signal's, for a request on its way): a higher class preempts a
lower one, never an equal or higher one (`tidal.policy.class_preempt` decides when). Online
work is never offloaded or checkpointed by a plan. Any other plan that evicts an online
request is refused (`RefusalReason.ONLINE_EVICTION`). When KV runs out for an online request
and nothing of a lower class is left to evict, the online request waits for memory or, when
nothing can free any, ends with `finish_reason` "error" and a message saying why; it never
ends as a silent "length".

Atomicity: when any stage fails, every request is put back as it was before the plan (a swap or
an offload is undone by moving the KV back); a request that cannot be put back is recomputed
and counted (`Outcome.num_recomputed_on_failure`). Then the refusal is raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["IDLE", "StepPlan"]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step of one instance: everything the batch scheduler decided."""

    prefill: Mapping[str, int] = field(default_factory=dict)  # req_id -> prompt tokens this step
    decode: tuple[str, ...] = ()  # req_ids decoding one token, attention on the GPU
    cpu_decode: tuple[str, ...] = ()  # offloaded req_ids decoding one token, attention on CPU
    abort_no_kv: tuple[str, ...] = ()  # req_ids that cannot get KV memory and that nothing else
    # can free it for: end them now with finish_reason "error" and a message saying so
    checkpoint: tuple[str, ...] = ()  # running offline req_ids: copy their full KV blocks not
    # yet saved to host memory (incremental; `EngineCapabilities.kv_checkpoint`)
    recompute: tuple[str, ...] = ()  # offline req_ids: drop KV, requeue at head, recompute later
    release: tuple[str, ...] = ()  # checkpointed offline running req_ids: free their GPU blocks
    # now (no copy), swapped with the checkpoint as their KV; the tail past it is recomputed
    swap_out: tuple[str, ...] = ()  # offline running req_ids: KV to host memory, paused
    swap_in: tuple[str, ...] = ()  # swapped req_ids: KV back to the GPU
    offload: tuple[str, ...] = ()  # offline decoding req_ids: KV to host, decode on CPU workers
    recall: tuple[str, ...] = ()  # offloaded req_ids: KV back to the GPU
    max_repeat: int = 1  # decode-only plans: most steps the same batch may run back to back
    # before the policy is asked again (ending early when a request finishes or anything
    # arrives). A permission: re-planning every step decides the same (the live instance does;
    # the simulator runs the steps as one span)
    layer_cut: bool = False  # True: an online request arriving at this instance during the step
    # cuts it at the next layer boundary (OOCO §3.4.1); set it only on offline-only steps
    evict_below: int | None = None  # the priority of an online request on its way here that
    # the evictions make room for (the preempt signal, sent before the request is routed): an
    # online request of a lower priority may then be evicted though none waits here yet

    def __post_init__(self) -> None:
        if self.max_repeat < 1:
            raise ValueError(f"max_repeat must be >= 1, got {self.max_repeat}")

    @property
    def num_tokens(self) -> dict[str, int]:
        """req_id -> tokens computed this step (a decode computes 1)."""
        return dict(self.prefill) | dict.fromkeys(self.decode, 1)

    @property
    def total_tokens(self) -> int:
        return sum(self.prefill.values()) + len(self.decode)

    @property
    def evicts(self) -> tuple[str, ...]:
        """req_ids this plan takes KV away from (recompute, release, swap out, offload)."""
        return (*self.recompute, *self.release, *self.swap_out, *self.offload)

    @property
    def is_empty(self) -> bool:
        return not (
            self.abort_no_kv
            or self.prefill
            or self.decode
            or self.cpu_decode
            or self.checkpoint
            or self.recompute
            or self.release
            or self.swap_out
            or self.swap_in
            or self.offload
            or self.recall
        )

    @property
    def computes(self) -> bool:
        """The plan runs a step (prefill, GPU or CPU decodes)."""
        return bool(self.prefill or self.decode or self.cpu_decode)


IDLE = StepPlan()
