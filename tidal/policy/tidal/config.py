"""Tidal's combination config: every borrowed mechanism is one flag (ablations are one flag)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TidalConfig:
    """Switches of the `tidal` policy; OOCO's own knobs live in the `ooco` sub-section."""

    pull_migration: bool = True
    """OOCO §3.4.3 pull of offline decodes by strict instances (Alg. 1)."""
    gating: bool = True
    """OOCO §3.4.2 offline gating cost model on relaxed instances."""
    prefix_order: bool = True
    """HyGen App. A.2/A.3: offline dispatch order from the prefix trie + freshness."""
    utility_ratio: float = 0.9
    """HyGen App. A.3 u: chance to take the next offline request in trie order (else stalest)."""
    length_aware_routing: bool = True
    """TaiChi Alg. 2 over the relaxed instances for online prefill (TTFT-feasible, least queued)."""
    admission_control: bool = True
    """OmniServe §3.3.3: reject an online request whose prefill cannot meet its TTFT SLO."""
    cpu_offload: bool = True
    """OmniServe §3.3.5: offline decodes evicted for lack of KV decode on the CPU-attention
    workers instead of being swapped/recomputed; piggybacked per §3.3.6."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.utility_ratio <= 1.0:
            raise ValueError("utility_ratio must be in [0, 1]")
