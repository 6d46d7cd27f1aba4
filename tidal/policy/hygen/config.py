"""HyGen's knobs (papers/hygen.md §4, App. A), one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HygenConfig:
    """Configuration of HyGen's two-phase SLO-aware scheduler and offline order."""

    latency_budget_s: float = 0.05
    """L of Alg. 2: the per-step latency budget found by the SLO-aware profiler (§4.2)."""
    chunk_size: int = 512
    """C of Alg. 2: token budget of one step (chunked prefill, Sarathi-style)."""
    block_size: int = 16
    """KV block size in tokens (GET_NUM_BLOCKS)."""
    prefix_sharing: bool = True
    """App. A.2: order the offline queue by the prefix trie's DFS order (False: FCFS)."""
    utility_ratio: float = 1.0
    """u of App. A.3 Alg. 4: chance to take the next offline request from the prefix trie
    rather than the stalest one (1.0 = plain A.2 order; lower = more freshness)."""
    async_offline: bool = False
    """App. A.1 Alg. 2: plan the offline phase one step ahead and reconcile on arrivals."""

    def __post_init__(self) -> None:
        if self.latency_budget_s <= 0:
            raise ValueError("latency_budget_s must be > 0 seconds")
        if self.chunk_size < 1 or self.block_size < 1:
            raise ValueError("chunk_size and block_size must be >= 1 token")
        if not 0.0 <= self.utility_ratio <= 1.0:
            raise ValueError("utility_ratio must be in [0, 1]")
