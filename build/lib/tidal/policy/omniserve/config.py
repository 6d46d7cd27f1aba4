"""OmniServe's knobs (papers/omniserve.md §3.3), one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OmniConfig:
    """Online Scheduler configuration. The paper's per-layer bounds S/d − γ are applied to the
    whole step (S − d·γ) because our latency models predict whole steps."""

    num_layers: int = 60
    """d: transformer layers (per-layer SLO share S/d, piggyback granularity)."""
    comm_overhead_per_layer_s: float = 0.0
    """γ(n): collective/p2p cost per layer not already inside the step model, seconds."""
    piggyback_overhead_per_layer_s: float = 0.0002
    """ω: per-layer time reserved for piggybacked dense work of CPU-attention decodes (§3.3.4-5)."""
    admission_control: bool = True
    """§3.3.3: reject an LS request at arrival when its prefill cannot meet the TTFT SLO."""
    cpu_offload: bool = True
    """§3.3.5: BE decodes that do not fit on the GPU decode with CPU attention."""
    delayed_swap_in: bool = True
    """§3.2.4/§3.3.5: recall an offloaded BE decode only at a token boundary and only when the
    GPU has had slack for `swap_in_patience_steps` consecutive steps."""
    swap_in_patience_steps: int = 4
    """Consecutive slack steps before offloaded BE decodes are recalled (delayed swap-in)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("num_layers (d) must be >= 1")
        if self.comm_overhead_per_layer_s < 0 or self.piggyback_overhead_per_layer_s < 0:
            raise ValueError("overheads γ and ω must be >= 0 seconds")
        if self.swap_in_patience_steps < 0:
            raise ValueError("swap_in_patience_steps must be >= 0")
