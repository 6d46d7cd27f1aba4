"""A baseline at its best setting: `--best-of POLICY.PARAM=V1,V2,...`.

A baseline's figure depends on its knobs (online-priority's decode batch cap, say); compared at
one arbitrary setting it can look worse than it is. Each spec names one of a policy's params
and the values to try; several specs for one policy try every combination. Each combination
runs the same search, and the one with the most offline tokens/s within the cap wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import yaml

from tidal.config.cluster import ClusterConfig

Setting = tuple[tuple[str, Any], ...]  # ((param, value), ...) of one policy


def parse_best_of(specs: Sequence[str], policies: Sequence[str]) -> dict[str, list[Setting]]:
    """policy -> the settings to try, from `POLICY.PARAM=V1,V2,...` specs."""
    grid: dict[str, dict[str, list[Any]]] = {}
    for spec in specs:
        key, eq, values = spec.partition("=")
        pol, dot, param = key.strip().partition(".")
        if not eq or not dot or not pol or not param:
            raise ValueError(f"--best-of {spec!r}: expected POLICY.PARAM=V1,V2,...")
        if pol not in policies:
            raise ValueError(f"--best-of {spec!r}: policy {pol!r} is not in --policies")
        vals = [yaml.safe_load(v.strip()) for v in values.split(",") if v.strip()]
        if not vals:
            raise ValueError(f"--best-of {spec!r}: no values")
        if param in grid.setdefault(pol, {}):
            raise ValueError(f"--best-of: {pol}.{param} given twice")
        grid[pol][param] = vals
    out: dict[str, list[Setting]] = {}
    for pol, params in grid.items():
        names = list(params)
        out[pol] = [
            tuple(zip(names, combo, strict=True))
            for combo in itertools.product(*(params[n] for n in names))
        ]
    return out


def with_setting(cfg: ClusterConfig, policy: str, setting: Setting) -> ClusterConfig:
    """`cfg` with `policy`'s params overridden by `setting`."""
    params = {**cfg.policies.get(policy, {}), **dict(setting)}
    return replace(cfg, policies={**cfg.policies, policy: params})


def label(setting: Setting) -> str:
    """`max_decode_batch=64,min_free_decode=0.1`."""
    return ",".join(f"{k}={v}" for k, v in setting)


def pick_best(tokens_per_s: Mapping[str, float]) -> str:
    """The label with the most offline tokens/s (the first listed on a tie)."""
    if not tokens_per_s:
        raise ValueError("no settings were tried")
    return max(tokens_per_s, key=lambda k: tokens_per_s[k])
