from __future__ import annotations

import pytest

from tidal.cluster.membership import Membership
from tidal.cluster.routing import RoundRobinRouter
from tidal.schemas.messages import Heartbeat


def make_hb(
    service_id: str, kind: str = "instance", *, pid: int = 1, model: str = "m", status: str = "ok"
) -> Heartbeat:
    return Heartbeat(
        service_id=service_id,
        kind=kind,
        pid=pid,
        started_unix_s=0.0,
        sent_unix_s=0.0,
        status=status,
        model=model if kind == "instance" else "",
    )


def test_learns_and_forgets_silent_services() -> None:
    m = Membership(timeout_s=2.0)
    assert m.observe(make_hb("a"), now=0.0)
    assert not m.observe(make_hb("a"), now=1.0)  # same process: not new
    assert m.observe(make_hb("b"), now=1.5)
    assert m.expire(now=2.9) == []  # a last seen at 1.0: 1.9 s < 2 s
    gone = m.expire(now=3.1)
    assert [g.heartbeat.service_id for g in gone] == ["a"]
    assert [i.heartbeat.service_id for i in m.instances()] == ["b"]


def test_restarted_process_counts_as_new() -> None:
    m = Membership(timeout_s=2.0)
    m.observe(make_hb("a", pid=10), now=0.0)
    assert m.observe(make_hb("a", pid=11), now=0.5)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout"):
        Membership(timeout_s=0)


def test_round_robin_skips_excluded_and_draining_instances() -> None:
    m = Membership(timeout_s=5)
    for name in ("i0", "i1", "i2"):
        m.observe(make_hb(name), now=0)
    m.observe(make_hb("i3", status="draining"), now=0)
    router = RoundRobinRouter()
    picks = [router.route("m", m.instances(), exclude=["i1"]).instance_id for _ in range(4)]
    assert picks == ["i0", "i2", "i0", "i2"]


def test_routing_errors_name_the_reason() -> None:
    router = RoundRobinRouter()
    assert router.route("m", [], []).error_code == "no_capacity"
    m = Membership(timeout_s=5)
    m.observe(make_hb("i0", model="other"), now=0)
    decision = router.route("m", m.instances(), [])
    assert decision.error_code == "unknown_model"
    assert "other" in decision.message
    assert router.route("other", m.instances(), ["i0"]).error_code == "no_capacity"


def test_extend_gives_every_member_a_full_timeout_again() -> None:
    m = Membership(timeout_s=2.0)
    m.observe(make_hb("a"), 0.0)
    m.extend(5.0)  # the observer was cut off from 0 s to 5 s
    assert m.expire(6.0) == []
    assert [x.heartbeat.service_id for x in m.expire(7.5)] == ["a"]


def test_everyone_else_silent_at_once_means_the_observer_is_cut_off() -> None:
    m = Membership(timeout_s=2.0)
    m.observe(make_hb("s0", "scheduler"), now=10.0)  # the observer hears itself (local node)
    m.observe(make_hb("i0"), now=0.0)
    m.observe(make_hb("i1"), now=0.0)
    m.observe(make_hb("g0", "gateway"), now=3.0)
    assert not m.is_cut_off(4.0, "scheduler", "s0")  # i0 and i1 silent, the gateway is not
    assert m.is_cut_off(5.5, "scheduler", "s0")  # all three silent at once: it is us
    lone = Membership(timeout_s=2.0)
    lone.observe(make_hb("s0", "scheduler"), now=10.0)
    lone.observe(make_hb("i0"), now=0.0)
    assert not lone.is_cut_off(5.0, "scheduler", "s0")  # one other: a lost host is likelier
