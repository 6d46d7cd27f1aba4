"""Baseline policies the papers compare against, registered by name:

* ``aggregated`` — Sarathi-Serve chunked prefill on every instance (HyGen's and TaiChi's
  baseline); ``online_first: true`` gives HyGen's *Sarathi++*.
* ``pd-disagg`` — DistServe-style prefill/decode disaggregation (TaiChi's baseline).
* ``base-pd`` — OOCO §5.1.4 *base P/D*: P/D disaggregation, offline treated as online.
* ``online-priority`` — OOCO §5.1.4: base P/D plus online-first scheduling, offline admitted
  only when the prefill side is idle, a capped decode batch and offline preemption.
"""

from tidal.policy.baselines.aggregated import AggregatedConfig, AggregatedPolicy
from tidal.policy.baselines.online_priority import OnlinePriorityConfig, OnlinePriorityPolicy
from tidal.policy.baselines.pd import PdConfig, PdPolicy

__all__ = [
    "AggregatedConfig",
    "AggregatedPolicy",
    "OnlinePriorityConfig",
    "OnlinePriorityPolicy",
    "PdConfig",
    "PdPolicy",
]
