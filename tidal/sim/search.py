"""The papers' evaluation methods as searches over simulated runs.

* `max_offline` — OOCO §5.2: raise the uniform offline QPS from zero; the largest load at
  which the online SLO violation rate stays <= the threshold is the policy's maximum
  effective offline throughput.
* `goodput` — TaiChi §4.1 (after DistServe): the highest online request rate at which SLO
  attainment stays >= the target.
* `max_online` — OOCO §5.2's first step: the largest online trace scale factor (§5.1.3) at
  which pure online serving (no offline stream) stays within the violation cap.

Both grow the load geometrically until the condition fails, then bisect. Every probe is a full
deterministic run, so the answer is a function of (config, seed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tidal.config.cluster import ClusterConfig
from tidal.sim.build import simulate, with_offline_rate, with_online_rate
from tidal.sim.metrics import summarize

Probe = Callable[[float], dict[str, Any]]  # load -> summary


@dataclass
class SearchResult:
    """The probes of one policy's search and its answer."""

    policy: str
    best_rate: float  # the largest load that satisfied the condition (0 if none did)
    best: dict[str, Any] | None  # summary at best_rate
    probes: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (load, summary)
    saturated: bool = False  # max-offline: throughput stopped growing before the SLO broke


def _search(
    probe: Probe,
    ok: Callable[[dict[str, Any]], bool],
    start: float,
    max_rate: float,
    iters: int,
    saturated: Callable[[float, dict[str, Any]], bool] | None = None,
) -> tuple[float, dict[str, Any] | None, list[tuple[float, dict[str, Any]]], bool]:
    probes: list[tuple[float, dict[str, Any]]] = []

    def run(x: float) -> dict[str, Any]:
        s = probe(x)
        probes.append((x, s))
        return s

    good, good_s, bad = 0.0, None, None
    x = start
    while x <= max_rate:
        s = run(x)
        if not ok(s):
            bad = x
            break
        good, good_s = x, s
        if saturated is not None and saturated(x, s):
            return good, good_s, probes, True
        x *= 2
    if bad is None:
        return good, good_s, probes, False
    for _ in range(iters):
        mid = (good + bad) / 2
        s = run(mid)
        if ok(s):
            good, good_s = mid, s
        else:
            bad = mid
    return good, good_s, probes, False


def _prober(
    cfg: ClusterConfig,
    policy: str,
    configure: Callable[[float], ClusterConfig],
    key: str,
    on_probe: Callable[[str, float, dict[str, Any]], None] | None,
) -> Callable[[float], dict[str, Any]]:
    """One probe of a search: simulate `configure(x)`, summarise it, record x under `key`."""

    def probe(x: float) -> dict[str, Any]:
        c = configure(x)
        s = summarize(simulate(c, policy), c.duration_s, policy, cfg.name)
        s[key] = x
        if on_probe:
            on_probe(policy, x, s)
        return s

    return probe


def max_offline(
    cfg: ClusterConfig,
    policy: str,
    violation_pct: float,
    start_qps: float = 0.25,
    max_qps: float = 256.0,
    iters: int = 5,
    on_probe: Callable[[str, float, dict[str, Any]], None] | None = None,
    within: Callable[[dict[str, Any]], bool] | None = None,
) -> SearchResult:
    """OOCO §5.2 for one policy. `within(summary)` replaces the SLO check (online violation
    <= `violation_pct`), e.g. HyGen's tolerance on an aggregate metric (`tidal.sim.tolerance`)."""

    probe = _prober(cfg, policy, lambda qps: with_offline_rate(cfg, qps), "offline_qps", on_probe)

    def ok(s: dict[str, Any]) -> bool:
        if within is not None:
            return within(s)
        return bool(s["online"]["violation_pct"] <= violation_pct)

    def saturated(qps: float, s: dict[str, Any]) -> bool:
        # Offered offline work no longer completes: more load only grows the backlog.
        return bool(s["offline"]["requests_per_s"] < 0.8 * qps)

    base = probe(0.0)
    if not ok(base):
        return SearchResult(policy, 0.0, base, [(0.0, base)])
    best, best_s, probes, sat = _search(probe, ok, start_qps, max_qps, iters, saturated)
    if best_s is None:
        best, best_s = 0.0, base
    return SearchResult(policy, best, best_s, [(0.0, base), *probes], sat)


def goodput(
    cfg: ClusterConfig,
    policy: str,
    attainment_pct: float,
    start_rps: float = 0.5,
    max_rps: float = 1024.0,
    iters: int = 6,
    on_probe: Callable[[str, float, dict[str, Any]], None] | None = None,
) -> SearchResult:
    """TaiChi §4.1 for one policy: highest online rate with attainment >= target."""

    probe = _prober(cfg, policy, lambda rps: with_online_rate(cfg, rps), "online_rps", on_probe)

    def ok(s: dict[str, Any]) -> bool:
        return bool(s["online"]["slo_attainment_pct"] >= attainment_pct)

    best, best_s, probes, _ = _search(probe, ok, start_rps, max_rps, iters)
    return SearchResult(policy, best, best_s, probes)


def max_online(
    cfg: ClusterConfig,
    policy: str,
    violation_pct: float,
    start_scale: float = 0.25,
    max_scale: float = 64.0,
    iters: int = 6,
    on_probe: Callable[[str, float, dict[str, Any]], None] | None = None,
) -> SearchResult:
    """OOCO §5.2: "determine the traffic scaling factor for online requests such that the
    system can just meet the online traffic peak without SLO violations" — the largest
    §5.1.3 scale of the online trace at which `policy`, serving online requests only, keeps
    the online violation rate <= `violation_pct`. `best_rate` is that scale factor."""
    if cfg.online is None:
        raise ValueError("the config has no online stream to scale")
    online = cfg.online

    def only_online(scale: float) -> ClusterConfig:
        return replace(cfg, online=replace(online, rate=None, scale=scale), offline=None)

    probe = _prober(cfg, policy, only_online, "online_scale", on_probe)

    def ok(s: dict[str, Any]) -> bool:
        return bool(s["online"]["violation_pct"] <= violation_pct)

    best, best_s, probes, _ = _search(probe, ok, start_scale, max_scale, iters)
    return SearchResult(policy, best, best_s, probes)
