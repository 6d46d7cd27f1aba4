"""HyGen (papers/hygen.md): SLO-aware two-phase batch formation with an offline order that
maximises prefix sharing.

`batch` — Alg. 1 and the Alg. 2 workflow (sync and async reconcile); `prefix_order` — the prefix
trie in DFS order (App. A.2) and the freshness/utility-ratio extension (App. A.3); `profiler` —
the SLO-aware latency-budget search (§4.2). Configured by `HygenConfig`.
"""

from __future__ import annotations

from tidal.policy.hygen.batch import (
    Budget,
    HybridBatch,
    HyReq,
    reconcile_on_arrival,
    slo_aware_schedule,
    two_phase_schedule,
)
from tidal.policy.hygen.config import HygenConfig
from tidal.policy.hygen.prefix_order import FreshnessIndex, OfflineOrder, PrefixTrie
from tidal.policy.hygen.profiler import profile_budget_from_above, profile_latency_budget

__all__ = [
    "Budget",
    "FreshnessIndex",
    "HyReq",
    "HybridBatch",
    "HygenConfig",
    "OfflineOrder",
    "PrefixTrie",
    "profile_budget_from_above",
    "profile_latency_budget",
    "reconcile_on_arrival",
    "slo_aware_schedule",
    "two_phase_schedule",
]

# Registers the `hygen` and `hygen-star` policies.
from tidal.policy.hygen import policy as _policy  # noqa: F401
