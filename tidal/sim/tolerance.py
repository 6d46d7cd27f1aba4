"""HyGen §5.2's throughput experiment as searches over simulated runs (simulated results).

The SLO is a `Tolerance`: one aggregate online metric (mean / P99 TBT or TTFT) at most
(1 + ratio) x its value under pure online serving. For one tolerance:

1. *Pure online* (Sarathi, §5.1): the config's online stream alone under `online_policy`
   (`aggregated`); its metric is the reference and its throughput the denominator of the first
   headline ratio ("up to 3.87x overall throughput compared to pure online serving").
2. *HyGen\\** (§5.1): Sarathi++ serving offline requests "at a specific offline QPS ...
   profiled ... to guarantee bounded SLO interference": the largest uniform offline QPS whose
   run stays within the tolerance (`tidal.sim.search.max_offline` with this check).
3. *HyGen*: offline requests are a backlog (the config's offline stream, at a rate above what
   the GPU serves) and the SLO-aware profiler (§4.2) picks the largest per-step latency budget
   whose run stays within the tolerance (`profile_budget_from_above`); with several settings
   of its other params (`--best-of`, e.g. `online_prefill_budgeted`), the profile of each, the
   one with the most offline tokens/s kept.

Ratios: HyGen's online + offline tokens/s over pure online's (prompt + output tokens of finished
requests, and generated tokens only), and HyGen's offline tokens/s over HyGen\\*'s ("up to 5.84x
offline throughput gain" under the same SLO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tidal.config.cluster import ClusterConfig
from tidal.config.tolerance import Tolerance
from tidal.policy.hygen.profiler import profile_budget_from_above
from tidal.sim.best_of import Setting, label, with_setting
from tidal.sim.build import simulate
from tidal.sim.metrics import summarize
from tidal.sim.search import SearchResult, max_offline

OnProbe = Callable[[str, float, dict[str, Any]], None]


def run_summary(cfg: ClusterConfig, policy: str) -> dict[str, Any]:
    """One simulated run's summary."""
    return summarize(simulate(cfg, policy), cfg.duration_s, policy, cfg.name)


def pure_online(cfg: ClusterConfig, policy: str = "aggregated") -> dict[str, Any]:
    """The reference run: `cfg`'s online stream alone under `policy` (Sarathi: `aggregated`)."""
    if cfg.online is None:
        raise ValueError("the config has no online stream: no pure online reference")
    return run_summary(replace(cfg, offline=None), policy)


@dataclass
class BudgetResult:
    """HyGen's profiled latency budget and its run."""

    policy: str
    budget_s: float | None  # the largest budget within the tolerance (None: none was)
    best: dict[str, Any] | None  # summary at budget_s
    probes: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (budget, summary)
    setting: Setting = ()  # the policy params the search ran with, besides the budget
    others: list[BudgetResult] = field(default_factory=list)  # the other settings' searches


def budget_search(
    cfg: ClusterConfig,
    policy: str,
    within: Callable[[dict[str, Any]], bool],
    lo_s: float,
    hi_s: float,
    iters: int = 4,
    on_probe: OnProbe | None = None,
) -> BudgetResult:
    """HyGen §4.2's profiler on `cfg` as it stands (offline stream included): the largest
    `latency_budget_s` of `policy` in [lo_s, hi_s] whose run is `within` the SLO."""
    if cfg.offline is None:
        raise ValueError("the config has no offline stream for HyGen to serve")
    seen: dict[float, dict[str, Any]] = {}
    probes: list[tuple[float, dict[str, Any]]] = []

    def meets(budget_s: float) -> bool:
        s = run_summary(with_setting(cfg, policy, (("latency_budget_s", budget_s),)), policy)
        s["latency_budget_s"] = budget_s
        seen[budget_s] = s
        probes.append((budget_s, s))
        if on_probe:
            on_probe(policy, budget_s, s)
        return within(s)

    budget = profile_budget_from_above(meets, lo_s, hi_s, iterations=iters)
    return BudgetResult(policy, budget, None if budget is None else seen[budget], probes)


def best_budget_search(
    cfg: ClusterConfig,
    policy: str,
    within: Callable[[dict[str, Any]], bool],
    lo_s: float,
    hi_s: float,
    iters: int = 4,
    on_probe: OnProbe | None = None,
    settings: Sequence[Setting] = ((),),
) -> BudgetResult:
    """`budget_search` once per setting of `policy`'s other params; the one whose profiled
    budget gives the most offline tokens/s wins (the first listed when none meets the SLO),
    the others kept in its `others`."""
    if not settings:
        raise ValueError("no settings to profile")
    runs = [
        replace(
            budget_search(
                with_setting(cfg, policy, s), policy, within, lo_s, hi_s, iters, on_probe
            ),
            setting=s,
        )
        for s in settings
    ]

    def offline(r: BudgetResult) -> float:
        return -1.0 if r.best is None else float(r.best["offline"]["tokens_per_s"])

    best = max(runs, key=offline)  # max keeps the first of equals
    best.others = [r for r in runs if r is not best]
    return best


@dataclass
class ToleranceResult:
    """One tolerance: the reference, HyGen\\*'s profiled QPS and HyGen's profiled budget."""

    tolerance: Tolerance
    reference: dict[str, Any]  # pure online summary
    rate: SearchResult  # HyGen*: offline QPS search
    budget: BudgetResult  # HyGen: latency budget search

    def row(self) -> dict[str, Any]:
        """The figures `summary.json` keeps for this tolerance."""
        tol, ref = self.tolerance, self.reference
        star = self.rate.best or {}
        hy = self.budget.best or {}
        ref_total = ref["online"]["total_tokens_per_s"]
        ref_gen = ref["online"]["tokens_per_s"]

        def total(s: dict[str, Any], key: str) -> float:
            return float(s["online"][key] + s["offline"][key]) if s else 0.0

        def interference(s: dict[str, Any]) -> float | None:
            return tol.interference(s, ref) if s else None

        def budget_row(b: BudgetResult) -> dict[str, Any]:  # one setting's budget search
            s = b.best or {}
            return {
                "setting": label(b.setting),
                "latency_budget_s": b.budget_s,
                "offline_tokens_per_s": float(s.get("offline", {}).get("tokens_per_s", 0.0)),
                "offline_requests_per_s": s.get("offline", {}).get("requests_per_s", 0.0),
                "interference": interference(s),
                "probes": [(x, _probe(tol, ref, p)) for x, p in b.probes],
            }

        star_off = float(star.get("offline", {}).get("tokens_per_s", 0.0))
        hy_off = float(hy.get("offline", {}).get("tokens_per_s", 0.0))
        return {
            "tolerance": tol.label,
            "reference_s": tol.reference(ref),
            "bound_s": tol.bound(ref),
            "pure_online_total_tokens_per_s": ref_total,
            "rate_policy": {
                "policy": self.rate.policy,
                "offline_qps": self.rate.best_rate,
                "saturated": self.rate.saturated,
                "offline_tokens_per_s": star_off,
                "offline_requests_per_s": star.get("offline", {}).get("requests_per_s", 0.0),
                "interference": interference(star),
                "probes": [(x, _probe(tol, ref, s)) for x, s in self.rate.probes],
            },
            "budget_policy": {
                "policy": self.budget.policy,
                **budget_row(self.budget),
                "other_settings": [budget_row(o) for o in self.budget.others],
            },
            # HyGen §5.2's two headline ratios (None where a denominator is zero)
            "total_vs_pure_online": total(hy, "total_tokens_per_s") / ref_total
            if ref_total
            else None,
            "generated_vs_pure_online": total(hy, "tokens_per_s") / ref_gen if ref_gen else None,
            "offline_vs_rate_policy": hy_off / star_off if star_off else None,
        }


def _probe(tol: Tolerance, ref: dict[str, Any], s: dict[str, Any]) -> dict[str, float]:
    return {
        tol.metric: tol.value(s),
        "interference": tol.interference(s, ref),
        "offline_tokens_per_s": s["offline"]["tokens_per_s"],
        "online_total_tokens_per_s": s["online"]["total_tokens_per_s"],
        "offline_total_tokens_per_s": s["offline"]["total_tokens_per_s"],
    }


def tolerance_search(
    cfg: ClusterConfig,
    tol: Tolerance,
    reference: dict[str, Any],
    rate_policy: str = "hygen-star",
    budget_policy: str = "hygen",
    start_qps: float = 0.25,
    max_qps: float = 64.0,
    qps_iters: int = 4,
    budget_range_s: tuple[float, float] = (0.01, 0.1),
    budget_iters: int = 4,
    on_probe: OnProbe | None = None,
    budget_settings: Sequence[Setting] = ((),),
) -> ToleranceResult:
    """HyGen §5.2 for one tolerance (see the module docstring); `reference` is
    `pure_online(cfg)`, shared by every tolerance of one config. `budget_settings`: settings
    of the budget policy's other params to profile the budget at, the best kept
    (`best_budget_search`)."""

    def within(s: dict[str, Any]) -> bool:
        return tol.meets(s, reference)

    rate = max_offline(cfg, rate_policy, 100.0, start_qps, max_qps, qps_iters, on_probe, within)
    lo, hi = budget_range_s
    budget = best_budget_search(
        cfg, budget_policy, within, lo, hi, budget_iters, on_probe, budget_settings
    )
    return ToleranceResult(tol, reference, rate, budget)
