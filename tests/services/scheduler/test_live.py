"""LiveCluster, the scheduler's live half, on hand-built reports (no bus)."""

from __future__ import annotations

import time

import msgspec

from services.scheduler.live import SLOT_DOWN
from tests.services.scheduler.scheduler_kit import make_cluster
from tests.services.scheduler.test_scheduler import make_report
from tidal.policy.base import RouteAction
from tidal.policy.state import InstanceRole
from tidal.schemas.messages import ReqReport, RouteRequest


def test_a_request_routed_again_is_placed_again() -> None:
    # A recompute after its instance died re-routes the same req_id: place_decode must see it.
    c = make_cluster()
    now = time.time()
    c.placed["again"], c.retry_at["again"] = now, now + 10
    c.migrating.add("again")
    for i in (0, 1):
        c.on_report(make_report(f"inst-{i}", i, "aggregated"))
    ask = RouteRequest(req_id="again", model="m", req_class="online", max_tokens=4,
                       num_prompt_chars=40)  # fmt: skip
    c.route(c.new_request(ask, now), now, ask)
    assert "again" not in c.placed and "again" not in c.retry_at and "again" not in c.migrating


def test_the_held_queue_is_bounded_in_requests_and_in_tokens() -> None:
    from services.scheduler.reports import Held

    c = make_cluster()
    c.max_held, c.max_held_tokens = 3, 1000
    now = time.time()

    def ask(rid: str, chars: int, max_tokens: int) -> RouteRequest:
        return RouteRequest(req_id=rid, model="m", req_class="online", max_tokens=max_tokens,
                            num_prompt_chars=chars)  # fmt: skip

    big = c.new_request(ask("big", 4 * 600, 100), now)  # 600 prompt tokens (4 chars each)
    assert c.room_to_hold(big) == ""
    c.held["big"] = Held(big, None, ask("big", 4 * 600, 100), now)  # type: ignore[arg-type]
    assert "700 of 1000 tokens" in c.room_to_hold(c.new_request(ask("b", 4 * 250, 100), now))
    small = c.new_request(ask("s", 4 * 50, 10), now)
    assert c.room_to_hold(small) == ""
    for rid in ("s1", "s2"):
        c.held[rid] = Held(small, None, ask(rid, 200, 10), now)  # type: ignore[arg-type]
    assert "3 requests" in c.room_to_hold(small)
    c.max_held_tokens = 0  # no token bound: only the count
    c.max_held = 8
    assert c.room_to_hold(c.new_request(ask("huge", 4 * 10**6, 100), now)) == ""


def test_when_the_relaxed_host_is_lost_a_strict_instance_prefills_online_requests() -> None:
    # Issue 26: every process of the relaxed instance's host killed; the strict survivors
    # never prefilled, and every new online request got 503 for good.
    c = make_cluster("tidal", "relaxed,strict,strict")
    c.healer.heal_after_s = 1.0  # within the reports' freshness (REPORT_STALE_S)
    now = time.time()
    for i in (1, 2):
        c.on_report(make_report(f"inst-{i}", i, "strict"))
    ask = RouteRequest(req_id="chat", model="m", req_class="online", max_tokens=4,
                       num_prompt_chars=40)  # fmt: skip
    action, _, reason = c.route(c.new_request(ask, now), now, ask)
    assert (action, reason) == (RouteAction.HOLD, SLOT_DOWN)  # it may come back within seconds
    assert c.heal(now) == {}
    heal = c.heal(now + c.healer.heal_after_s)
    assert heal == {1: InstanceRole.AGGREGATED, 2: InstanceRole.AGGREGATED}
    for i in (1, 2):  # the survivors report their new role
        c.on_report(make_report(f"inst-{i}", i, "aggregated", seq=2))
    action, idx, _ = c.route(c.new_request(ask, now), now, ask)
    assert action is RouteAction.QUEUE and idx in (1, 2)
    assert c.num_stand_in_routes == 1
    # The relaxed instance is back: the survivors return to strict, online prefill to it.
    c.on_report(make_report("inst-0", 0, "relaxed"))
    assert c.heal(now + 2) == {1: InstanceRole.STRICT, 2: InstanceRole.STRICT}
    action, idx, _ = c.route(c.new_request(ask, now), now, ask)
    assert (action, idx) == (RouteAction.QUEUE, 0)


def test_a_push_toward_a_backed_off_target_waits_and_the_request_stays() -> None:
    c = make_cluster("tidal", "relaxed,strict,strict")
    now = time.time()
    prefilled = ReqReport("q1", "online", "running", now, 37, 32, 37, 1, 3, 3.0, 0.25)
    c.on_report(make_report("inst-0", 0, "relaxed", requests=[prefilled]))
    c.on_report(make_report("inst-1", 1, "strict"))
    until = c.backoff.failed("inst-1", now)  # its data plane could not be reached
    assert c.decode_placements(c.view(now), now) == []  # no attempt while backed off
    assert c.retry_at["q1"] == until
    assert c.decode_placements(c.view(until), until) == [("q1", 0, 1)]
    # A restarted target process starts with a clean slate.
    c.backoff.failed("inst-1", until)
    restarted = msgspec.structs.replace(
        make_report("inst-1", 1, "strict", seq=1), started_unix_s=now + 1
    )
    assert c.on_report(restarted)
    assert not c.backoff.is_backed_off("inst-1", until)


class _Rejecting:
    """A policy whose admission control turns every online arrival away."""

    name = "rejecting"

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, attr: str) -> object:
        return getattr(self.inner, attr)

    def route(self, req: object, cluster: object, now: float) -> object:
        from tidal.policy.base import Route

        return Route.reject("would miss its TTFT SLO")


def test_admission_control_never_loses_a_re_placed_request() -> None:
    """A request whose instance failed it mid-stream (its client already has tokens) is placed
    again even when the policy's admission control would turn a new arrival away."""
    c = make_cluster()
    c.policy = _Rejecting(c.policy)  # type: ignore[assignment]
    now = time.time()
    for i in (0, 1):
        c.on_report(make_report(f"inst-{i}", i, "aggregated"))
    new = RouteRequest(req_id="new", model="m", req_class="online", max_tokens=4,
                       num_prompt_chars=40)  # fmt: skip
    assert c.route(c.new_request(new, now), now, new)[0] is RouteAction.REJECT
    again = msgspec.structs.replace(new, req_id="again", exclude=["inst-1"],
                                    excluded_at_unix_s=now + 1)  # fmt: skip
    action, idx, _ = c.route(c.new_request(again, now), now, again)
    assert (action, idx) == (RouteAction.QUEUE, 0)  # a live instance, not the one that failed it


def test_a_process_declared_dead_while_it_lived_may_take_a_rerun_that_excludes_it() -> None:
    """A cut link got inst-0 forgotten and its streams re-run, excluding it; the same process
    is heard again. It failed nothing, and it may be the only instance of its role: a re-run
    excluding it must not be held until the hold bound."""
    c = make_cluster()
    now = time.time()
    c.on_report(make_report("inst-0", 0, "aggregated"))
    c.forget("inst-0")
    started = c.reports[0].started_unix_s
    ask = RouteRequest(req_id="r.r1", model="m", req_class="online", max_tokens=4,
                       num_prompt_chars=40, exclude=["inst-0"],
                       excluded_at_unix_s=started)  # fmt: skip
    assert c.route(c.new_request(ask, now), now, ask)[0] is not RouteAction.QUEUE  # none up
    c.on_report(make_report("inst-0", 0, "aggregated", seq=2))  # the same process, back
    action, idx, _ = c.route(c.new_request(ask, now), now, ask)
    assert (action, idx) == (RouteAction.QUEUE, 0)
    c.on_report(make_report("inst-1", 1, "aggregated"))  # never forgotten: still excluded
    other = msgspec.structs.replace(ask, req_id="o.r1", exclude=["inst-1", "inst-0"])
    c.forget("inst-0")
    assert c.route(c.new_request(other, now), now, other)[0] is not RouteAction.QUEUE


def test_a_request_without_max_tokens_is_planned_with_what_the_context_leaves() -> None:
    """The instance fits a default `max_tokens` to its context (`tidal.config.limits`); the
    scheduler plans with the same figure once reports say the context, not the default."""
    c = make_cluster()
    now = time.time()
    ask = RouteRequest(req_id="d", model="m", req_class="online", max_tokens=16384,
                       num_prompt_chars=4 * 1000, max_tokens_is_default=True)  # fmt: skip
    assert c.new_request(ask, now).max_output_tokens == 16384  # no report yet: nothing to fit
    for i in range(2):
        rep = make_report(f"inst-{i}", i, "aggregated")
        c.on_report(msgspec.structs.replace(rep, max_model_len=8192))
    assert c.new_request(ask, now).max_output_tokens == 8192 - 1000
    given = msgspec.structs.replace(ask, max_tokens_is_default=False)
    assert c.new_request(given, now).max_output_tokens == 16384  # the client's own: kept


def test_the_cluster_is_idle_only_with_nothing_held_routed_or_running() -> None:
    """The scheduler's tick waits out `IDLE_TICK_S` instead of `TICK_S` only then."""
    c = make_cluster()
    now = time.time()
    for i in range(2):
        c.on_report(make_report(f"inst-{i}", i, "aggregated"))
    assert c.is_idle()
    ask = RouteRequest(req_id="r", model="m", req_class="online", max_tokens=8,
                       num_prompt_chars=40)  # fmt: skip
    c.route(c.new_request(ask, now), now, ask)
    assert not c.is_idle()  # routed, not yet in a report
    shown = ReqReport("r", "online", "running", now, 10, 8, 10, 1, 1)
    c.on_report(make_report("inst-0", 0, "aggregated", seq=2, requests=[shown]))
    assert not c.is_idle()  # running
    done = make_report("inst-0", 0, "aggregated", seq=3)
    c.on_report(msgspec.structs.replace(done, finished_req_ids=["r"]))
    assert c.is_idle()
