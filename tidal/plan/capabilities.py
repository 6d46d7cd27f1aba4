"""What an engine can carry out of a `StepPlan`, declared once, read by the interpreter and the
policy adapter (no `getattr` probes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["EngineCapabilities", "MigrationMode"]


class MigrationMode(enum.StrEnum):
    KV = "kv"  # export/import move the KV of every layer: the target continues at once
    RECOMPUTE = "recompute"  # export/import move tokens only: the target prefills them again
    NONE = "none"  # requests cannot leave this engine


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """One engine's declared abilities; each maps to `StepPlan` fields it may be given."""

    layer_cut: bool = False  # `StepPlan.layer_cut`: stops a step between layers on request
    num_layers: int = 1  # layer boundaries a step can be cut at (1 when it cannot be cut)
    migration: MigrationMode = MigrationMode.NONE  # what export_request/import_request move
    cpu_attention: bool = False  # offload / recall / cpu_decode (OmniServe §3.2); see
    # `tidal.engine.torch.cpu_offload`: True only while CPU-attention workers are attached
    swap_is_recompute: bool = False  # swap_out drops the KV (the engine cannot move it to the
    # host); swap_in resubmits: the request recomputes. Counted as a recompute.
    priority: bool = False  # the engine itself runs online before offline work and retracts
    # offline work for online arrivals (SGLang's priority scheduling)
    self_driven: bool = False  # requests progress on their own: step even with an empty plan
    kv_checkpoint: bool = False  # `StepPlan.checkpoint` / `release`: offline KV saved to host
    # memory block by block while it decodes, so a preemption frees at once (ConServe)

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.layer_cut and self.num_layers < 2:
            raise ValueError("an engine that cuts steps between layers has >= 2 layers")
