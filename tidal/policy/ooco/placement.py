"""OOCO instance roles and task placement (papers/ooco.md Table 1, §3.2) and online preemption of
offline work on latency-relaxed instances at transformer-layer granularity (§3.4.1)."""

from __future__ import annotations

import math
from enum import StrEnum

# §3.2: RELAXED (§3.2.1: step time unrestricted; prefill of both classes + offline decode) and
# STRICT (§3.2.2: every step under the TPOT SLO; decode only) are roles of the shared interface.
from tidal.policy.state import InstanceRole


class Stage(StrEnum):
    """The two stages of a request that Table 1 places."""

    PREFILL = "prefill"
    DECODE = "decode"


def can_place(role: InstanceRole, is_online: bool, phase: Stage) -> bool:
    """OOCO Table 1: may this (class, phase) task run on an instance of this role?

    Online decode never runs on a relaxed instance (a long prefill step would break its TPOT);
    no prefill runs on a strict instance; offline decode runs on either pool.
    """
    if role is InstanceRole.RELAXED:
        return not (is_online and phase is Stage.DECODE)
    if role is InstanceRole.STRICT:
        return phase is Stage.DECODE
    raise ValueError(f"OOCO places tasks on relaxed/strict instances only, not {role}")


def layer_preemption_delay_s(step_s: float, elapsed_s: float, num_layers: int) -> float:
    """§3.4.1: an online prefill interrupts a running offline step at the next layer boundary.

    Returns the seconds until that boundary, given the running step's predicted duration and how
    long it has been running. Layers are taken as equal-cost (step_s / num_layers each).
    """
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    if step_s <= 0 or elapsed_s >= step_s:
        return 0.0
    layer_s = step_s / num_layers
    done_layers = math.floor(max(elapsed_s, 0.0) / layer_s)
    boundary_s = min((done_layers + 1) * layer_s, step_s)
    return boundary_s - max(elapsed_s, 0.0)


def should_preempt_offline(
    role: InstanceRole, running_offline_only: bool, num_online_prefills_waiting: int
) -> bool:
    """§3.4.1: preempt a relaxed instance's offline prefill/decode step when an online prefill
    waits; a step that already carries online work is never interrupted."""
    return role is InstanceRole.RELAXED and running_offline_only and num_online_prefills_waiting > 0
