from __future__ import annotations

import pytest

from tidal.policy import InstanceRole, PolicyContext, Slo, available_policies, make_policy
from tidal.policy.base import Policy, StepPlan
from tidal.policy.registry import register_policy

CTX = PolicyContext(2, (InstanceRole.PREFILL, InstanceRole.DECODE), Slo(1.0, 0.1))


def test_baselines_are_registered() -> None:
    names = available_policies()
    for n in ("aggregated", "pd-disagg", "base-pd", "online-priority"):
        assert n in names
        assert make_policy(n, CTX).name == n


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="aggregated"):
        make_policy("nope", CTX)


def test_bad_params_are_named() -> None:
    ctx = PolicyContext(2, CTX.roles, CTX.online_slo, {"max_decode_batchh": 3})
    with pytest.raises(ValueError, match="max_decode_batchh"):
        make_policy("online-priority", ctx)


def test_pd_needs_both_sides() -> None:
    ctx = PolicyContext(2, (InstanceRole.AGGREGATED,) * 2, CTX.online_slo)
    with pytest.raises(ValueError, match="prefill-side and decode-side"):
        make_policy("pd-disagg", ctx)


def test_register_a_new_policy() -> None:
    class Idle(Policy):
        def schedule(self, inst, now):  # type: ignore[no-untyped-def]
            return StepPlan()

    register_policy("test-idle")(lambda ctx: Idle())
    assert isinstance(make_policy("test_idle", CTX), Idle)
    with pytest.raises(ValueError, match="twice"):
        register_policy("test-idle")(lambda ctx: Idle())
