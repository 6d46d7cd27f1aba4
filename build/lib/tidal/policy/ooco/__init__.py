"""OOCO (papers/ooco.md): latency-constraint disaggregation for online-offline co-location.

Pure algorithms — Table 1 placement and layer-granularity preemption (`placement`), eviction by
bottleneck (`eviction`), offline gating (`gating`), push/pull migration with Alg. 1
(`migration`), mix decoding selection Alg. 2 (`mix_decode`) — configured by `OocoConfig`.
"""

from __future__ import annotations

from tidal.policy.ooco.config import OocoConfig
from tidal.policy.ooco.eviction import choose_victims, is_compute_bound
from tidal.policy.ooco.gating import GatingDecision, gate_offline_prefill
from tidal.policy.ooco.migration import (
    LengthPreference,
    PrefKind,
    PushDecision,
    StrictView,
    choose_push_target,
    length_preference,
    select_for_pull,
)
from tidal.policy.ooco.mix_decode import (
    DecodeCandidate,
    MixDecodeSelection,
    largest_fitting_prefix,
    select_mix_decode,
)
from tidal.policy.ooco.placement import (
    InstanceRole,
    Stage,
    can_place,
    layer_preemption_delay_s,
    should_preempt_offline,
)

__all__ = [
    "DecodeCandidate",
    "GatingDecision",
    "InstanceRole",
    "LengthPreference",
    "MixDecodeSelection",
    "OocoConfig",
    "PrefKind",
    "PushDecision",
    "Stage",
    "StrictView",
    "can_place",
    "choose_push_target",
    "choose_victims",
    "gate_offline_prefill",
    "is_compute_bound",
    "largest_fitting_prefix",
    "layer_preemption_delay_s",
    "length_preference",
    "select_for_pull",
    "select_mix_decode",
    "should_preempt_offline",
]

# Registers the `ooco` policy (imported last: the policy module uses the algorithms above).
from tidal.policy.ooco import policy as _policy  # noqa: F401
