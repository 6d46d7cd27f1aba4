"""Roles heal: survivors stand in for a role no live instance has, after a grace period, and go
back once it returns; the instance half of OOCO/Tidal then prefills on a former strict one."""

from __future__ import annotations

import pytest

from tidal.cluster.healing import RoleHealer, lost_parts, stand_in
from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass

R = InstanceRole
RS = [R.RELAXED, R.STRICT, R.STRICT]


def make_instance(i: int, role: InstanceRole, waiting_tokens: int = 0) -> InstanceState:
    inst = InstanceState(i, role, 256, 64, 16, 1000, 1000, LinearStepModel(), 1000.0, 25e9)
    inst.num_waiting_tokens = waiting_tokens
    return inst


def online(rid: str, phase: Phase = Phase.WAITING, computed: int = 0, out: int = 0) -> ReqState:
    r = ReqState(rid, RequestClass.ONLINE, 0.0, 300, 20, Slo(2.0, 0.1))
    r.phase, r.num_computed_tokens, r.num_output_tokens = phase, computed, out
    r.num_blocks = (computed + 15) // 16
    return r


def test_parts_are_lost_only_when_no_alive_role_does_them() -> None:
    assert lost_parts(RS, [1, 2]) == ["prefill"]  # OOCO: the relaxed host is gone
    assert lost_parts(RS, [0]) == ["decode"]
    assert lost_parts(RS, [0, 2]) == []
    # TaiChi: P-heavy and D-heavy both prefill and decode; losing every P-heavy loses nothing.
    assert lost_parts([R.P_HEAVY, R.D_HEAVY], [1]) == []
    assert lost_parts([R.AGGREGATED] * 2, []) == ["prefill", "decode"]


def test_survivors_stand_in_after_the_grace_period_and_go_back_when_the_role_returns() -> None:
    healer = RoleHealer(heal_after_s=5.0)
    up = {1, 2}
    assert healer.update(RS, up.__contains__, now=100.0) == {}
    assert healer.update(RS, up.__contains__, now=104.9) == {}  # a restart may bring it back
    assert not healer.is_healing
    assert healer.update(RS, up.__contains__, now=105.0) == {1: R.AGGREGATED, 2: R.AGGREGATED}
    assert healer.is_healing and healer.num_heals == 2
    assert healer.update(RS, up.__contains__, now=106.0) == {}  # sent once
    up.add(0)  # a relaxed instance is back: everyone returns to its own role
    assert healer.update(RS, up.__contains__, now=107.0) == {1: R.STRICT, 2: R.STRICT}
    assert not healer.is_healing and healer.lost_since == {}


def test_a_role_that_comes_back_within_the_grace_period_heals_nothing() -> None:
    healer = RoleHealer(heal_after_s=5.0)
    assert healer.update(RS, {1, 2}.__contains__, now=0.0) == {}
    assert healer.update(RS, {0, 1, 2}.__contains__, now=3.0) == {}
    assert healer.update(RS, {1, 2}.__contains__, now=6.0) == {}  # lost again: a fresh clock
    assert healer.num_heals == 0
    with pytest.raises(ValueError, match="heal_after_s"):
        RoleHealer(heal_after_s=-1)


def test_the_stand_in_is_the_least_loaded_usable_instance() -> None:
    view = ClusterView(
        [make_instance(0, R.RELAXED), make_instance(1, R.STRICT, 900), make_instance(2, R.STRICT)],
        [],
        1e9,
    )
    assert stand_in(view, {1, 2}.__contains__) == 2
    assert stand_in(view, {1}.__contains__) == 1
    assert stand_in(view, set().__contains__) is None


@pytest.mark.parametrize("policy", ["ooco", "tidal"])
def test_a_strict_instance_standing_in_prefills_online_requests(policy: str) -> None:
    ctx = PolicyContext(3, tuple(RS), Slo(2.0, 0.1), {}, seed=0)
    pol = make_policy(policy, ctx)
    strict = make_instance(1, R.STRICT)
    strict.waiting.append(online("new"))
    decoding = online("dec", Phase.RUNNING, computed=310, out=11)
    strict.running.append(decoding)
    strict.role = R.AGGREGATED  # the scheduler's set_role while healing
    plan = pol.schedule(strict, 0.0)
    assert "new" in plan.prefill and "dec" in plan.decode
    # Healed back to strict with that prefill unfinished: it finishes it, never strands it.
    strict.role = R.STRICT
    plan = pol.schedule(strict, 0.0)
    assert "new" in plan.prefill
    strict.waiting.clear()
    assert pol.schedule(strict, 0.0).prefill == {}  # an ordinary strict step again


def test_stand_in_off_keeps_ooco_roles() -> None:
    ctx = PolicyContext(3, tuple(RS), Slo(2.0, 0.1), {"stand_in": False}, seed=0)
    pol = make_policy("ooco", ctx)
    strict = make_instance(1, R.AGGREGATED)
    strict.waiting.append(online("new"))
    assert pol.schedule(strict, 0.0).prefill == {}
