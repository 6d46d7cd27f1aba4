"""TaiChi (papers/taichi.md §3): P-heavy / D-heavy instances set by three sliders (R_PD, S_p,
S_d), length-aware prefill routing (Alg. 2, `routing`) and flowing decode (Alg. 1, `flowing`).
Configured by `TaichiConfig`."""

from __future__ import annotations

from tidal.policy.taichi.config import TaichiConfig
from tidal.policy.taichi.flowing import (
    DecodeHost,
    FlowReq,
    choose_decode_host,
    least_loaded,
    select_backflow,
    select_degrading,
)
from tidal.policy.taichi.routing import PrefillTarget, estimate_prefill_s, route_prefill

__all__ = [
    "DecodeHost",
    "FlowReq",
    "PrefillTarget",
    "TaichiConfig",
    "choose_decode_host",
    "estimate_prefill_s",
    "least_loaded",
    "route_prefill",
    "select_backflow",
    "select_degrading",
]

# Registers the `taichi` policy.
from tidal.policy.taichi import policy as _policy  # noqa: F401
