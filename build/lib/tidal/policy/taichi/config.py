"""TaiChi's knobs (papers/taichi.md §3), one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Infeasible = Literal["random", "reject", "least-loaded"]


@dataclass(frozen=True)
class TaichiConfig:
    """The three sliders of §3.1 plus the two scheduling mechanisms of §3.3–3.4."""

    num_p_heavy: int = -1
    """R_PD as a count: how many instances are P-heavy (the first ones); -1 = half, rounded up."""
    chunk_p: int = 0
    """S_p: chunk size (tokens per step) of P-heavy instances; 0 keeps each instance's configured
    chunk size (the experiment file's `instances[].chunk_size`, where TaiChi's sliders live)."""
    chunk_d: int = 0
    """S_d: chunk size of D-heavy instances; 0 keeps the configured one."""
    memory_watermark: float = 0.95
    """M of Alg. 1: D-heavy HBM use above this fraction degrades its longest decodes (§3.3 ②)."""
    approach_factor: float = 0.96
    """α of Alg. 1: a P-heavy decode whose TPOT exceeds α·SLO flows back (§3.3 ③)."""
    on_infeasible: Infeasible = "random"
    """Alg. 2 returns ∅: 'random' instance (the paper's experiments; drawn among instances whose
    chunk budget is not all decodes), 'reject' (early rejection) or 'least-loaded' (fewest
    queued prefill tokens)."""
    length_aware_routing: bool = True
    """§3.4 Alg. 2; False routes every prefill to the least-loaded P-heavy instance."""
    flowing_decode: bool = True
    """§3.3 Alg. 1; False decodes where prefilled (pure aggregation of the hybrid roles)."""

    def __post_init__(self) -> None:
        if self.num_p_heavy < -1:
            raise ValueError("num_p_heavy must be >= 0, or -1 for half the instances")
        if self.chunk_p < 0 or self.chunk_d < 0:
            raise ValueError("chunk_p (S_p) and chunk_d (S_d) must be >= 1 token (0: configured)")
        if not 0 < self.memory_watermark <= 1:
            raise ValueError("memory_watermark M must be in (0, 1]")
        if not 0 < self.approach_factor <= 1:
            raise ValueError("approach_factor α must be in (0, 1]")
        if self.on_infeasible not in ("random", "reject", "least-loaded"):
            raise ValueError("on_infeasible must be 'random', 'reject' or 'least-loaded'")

    def p_heavy_count(self, num_instances: int) -> int:
        """Number of P-heavy instances among `num_instances` (R_PD)."""
        n = (num_instances + 1) // 2 if self.num_p_heavy < 0 else self.num_p_heavy
        return min(n, num_instances)
