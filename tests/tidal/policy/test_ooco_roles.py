"""OOCO (and Tidal, its subclass) decide with the roles instances report now, so `tidal ctl roles`
(or any set_role) changes what they do, on the scheduler and in each instance's own policy."""

from __future__ import annotations

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass

R = InstanceRole
RS = (R.RELAXED, R.STRICT, R.STRICT)


def make_instance(i: int, role: InstanceRole) -> InstanceState:
    return InstanceState(i, role, 256, 64, 16, 1000, 1000, LinearStepModel(), 1000.0, 25e9)


def request(rid: str, online: bool) -> ReqState:
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    r = ReqState(rid, cls, 0.0, 100, 20, Slo(2.0, 0.1) if online else None)
    r.phase = Phase.WAITING
    return r


@pytest.mark.parametrize("policy", ["ooco", "tidal"])
def test_a_strict_instance_set_to_relaxed_is_routed_to_and_prefills(policy: str) -> None:
    pol = make_policy(policy, PolicyContext(3, RS, Slo(2.0, 0.1), {}, seed=0))
    insts = [make_instance(i, r) for i, r in enumerate(RS)]
    view = ClusterView(insts, [], 25e9)
    pol.tick(view, 0.0)  # the first look
    insts[0].waiting.append(request("busy", True))  # relaxed 0 has online prefill queued
    insts[1].role = R.RELAXED  # tidal ctl roles: instance 1 is relaxed now
    pol.tick(view, 1.0)
    assert pol.route(request("on", True), view, 1.0).instance_id == 1
    # Instance 1's own policy object (live: one per instance) prefills offline work there now.
    inst = make_policy(policy, PolicyContext(3, RS, Slo(2.0, 0.1), {}, seed=0))
    insts[1].waiting.append(request("off", False))
    assert "off" in inst.schedule(insts[1], 1.0).prefill


def test_a_relaxed_instance_set_to_strict_gets_no_more_online_prefill() -> None:
    roles = (R.RELAXED, R.RELAXED, R.STRICT)
    pol = make_policy("ooco", PolicyContext(3, roles, Slo(2.0, 0.1), {}, seed=0))
    insts = [make_instance(i, r) for i, r in enumerate(roles)]
    view = ClusterView(insts, [], 25e9)
    pol.tick(view, 0.0)
    insts[1].waiting.append(request("busy", True))
    assert pol.route(request("a", True), view, 0.0).instance_id == 0
    insts[0].role = R.STRICT
    assert pol.route(request("b", True), view, 1.0).instance_id == 1
    # Its own policy runs it as strict: no offline prefill (OOCO's strict instances only decode).
    insts[0].waiting.append(request("off", False))
    assert pol.schedule(insts[0], 1.0).prefill == {}


def test_a_stale_view_does_not_undo_the_policys_own_roles() -> None:
    # Config roles all relaxed; OOCO (num_relaxed=1) makes instances 1, 2 strict by set_role.
    ctx = PolicyContext(3, (R.RELAXED,) * 3, Slo(2.0, 0.1), {"num_relaxed": 1}, seed=0)
    pol = make_policy("ooco", ctx)
    insts = [make_instance(i, R.RELAXED) for i in range(3)]
    view = ClusterView(insts, [], 25e9)
    acts = pol.tick(view, 0.0)
    assert acts.set_role == {1: R.STRICT, 2: R.STRICT}
    pol.tick(view, 1.0)  # the set_role has not landed yet: the view still says relaxed
    assert pol.relaxed == [0] and pol.strict == [1, 2]
