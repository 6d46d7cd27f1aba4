"""`StepPlan`: one step of one instance, as a policy decides it and an engine carries it out.

The only step-plan type in Tidal: policies return it (`Policy.schedule`), the simulator applies it
(`tidal.sim.apply`), and the live instance's executor (`tidal.engine.executor`) turns it into
engine calls; the engines' own FCFS planner (`tidal.engine.planner`) builds one too.
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
    preempt: tuple[str, ...] = ()  # running req_ids: drop KV, requeue at head, recompute later
    swap_out: tuple[str, ...] = ()  # running req_ids: KV to host memory, paused
    swap_in: tuple[str, ...] = ()  # swapped req_ids: KV back to the GPU
    offload: tuple[str, ...] = ()  # running req_ids: KV to host, decode on CPU-attention workers
    recall: tuple[str, ...] = ()  # offloaded req_ids: KV back to the GPU
    max_repeat: int = 1  # decode-only plans: steps it may run back to back (speed hint)
    preemptible_layers: int = 0  # > 0: an online request arriving at this instance during
    # this step cuts it at the next of this many equal layer boundaries and its work is
    # discarded (OOCO §3.4.1 layer-level preemption); set it only on offline-only steps

    @property
    def num_tokens(self) -> dict[str, int]:
        """req_id -> tokens computed this step (a decode computes 1)."""
        return dict(self.prefill) | dict.fromkeys(self.decode, 1)

    @property
    def total_tokens(self) -> int:
        return sum(self.prefill.values()) + len(self.decode)

    @property
    def is_empty(self) -> bool:
        return not (
            self.prefill
            or self.decode
            or self.cpu_decode
            or self.preempt
            or self.swap_out
            or self.swap_in
            or self.offload
            or self.recall
        )


IDLE = StepPlan()
