"""HyGen's knobs (papers/hygen.md §4, App. A), one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HygenConfig:
    """Configuration of HyGen's two-phase SLO-aware scheduler and offline order."""

    latency_budget_s: float = 0.0
    """L of Alg. 2: the per-step latency budget found by the SLO-aware profiler (§4.2);
    0 means "the online TPOT SLO" (the naive budget of §5.3, Fig. 7)."""
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
    offline_qps_cap: float = 0.0
    """HyGen* of §5.1: admit offline requests at most at this rate (requests/s); 0 = no cap."""
    offline_preemption: str = "swap"
    """How a preempted offline request keeps its state (§4.1 "reclaimed into the offline queue,
    where they maintain their execution state"). HyGen is built on Sarathi-Serve (§5.1), whose
    `_preempt` frees the KV blocks and puts the sequence back at the head of the waiting queue
    with its generated tokens kept, to be rebuilt by chunked prefill under the latency budget:
    "recompute" (configs/hygen.yaml). "swap" (the default, kept for compatibility) copies the
    KV to host memory over PCIe instead (vLLM's swap mode), stalling the step that carries the
    copy, and starts no new offline prompt while any offline KV sits on the host."""
    admit_whole_prompt: bool = False
    """Start a waiting offline request only when its whole prompt's KV fits the memory not
    already promised to running prefills, as Sarathi-Serve (HyGen's base, §5.1) allocates a
    prompt's blocks at admission (configs/hygen.yaml). False (the default): admit chunk by
    chunk, Alg. 1 line 19 alone."""
    online_prefill_budgeted: bool = True
    """Whether the latency budget t also sizes the online phase's prefill chunks. True (the
    default): Alg. 1 as written, line 15's get_max_prefill(t, c, m, r) in both phases. False:
    online chunks are bounded by the chunk size c and memory only (as Sarathi runs them), and t
    bounds what the offline phase adds. §4.1 describes the budget as the offline phase's ("the
    remaining capacity is filled with offline requests ... based on the available batch
    execution latency budget, i.e., the latency slack"), line 8 already exempts online decodes
    from t, and in the online phase l = 0 leads to preemption and a retry (lines 22-24), which
    can only free memory. A P99 TTFT tolerance needs False: a budget small enough to bound the
    offline top-ups would otherwise cut long online prompts into more steps
    (docs/results/hygen/README.md, `tidal sim tolerance --best-of`)."""
    offline_buffer: int = 2
    """Policy: offline requests dispatched to an instance's queue at a time (the rest wait in
    the policy's prefix-ordered offline queue)."""
    decode_repeat: int = 4
    """Policy: `max_repeat` of decode-only plans (a simulator speed hint)."""

    def __post_init__(self) -> None:
        if self.latency_budget_s < 0:
            raise ValueError("latency_budget_s must be >= 0 seconds (0: the TPOT SLO)")
        if self.offline_qps_cap < 0 or self.offline_buffer < 1 or self.decode_repeat < 1:
            raise ValueError("offline_qps_cap >= 0, offline_buffer >= 1, decode_repeat >= 1")
        if self.chunk_size < 1 or self.block_size < 1:
            raise ValueError("chunk_size and block_size must be >= 1 token")
        if self.offline_preemption not in ("recompute", "swap"):
            raise ValueError('offline_preemption must be "recompute" or "swap"')
        if not 0.0 <= self.utility_ratio <= 1.0:
            raise ValueError("utility_ratio must be in [0, 1]")
