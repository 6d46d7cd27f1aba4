"""The scheduler's picture of the cluster (`services.scheduler.reports`): reports, routed and held
requests turned into the policy's view, on hand-built reports (no bus)."""

from __future__ import annotations

import time

import msgspec

from services.scheduler.live import LiveCluster
from services.scheduler.reports import Held
from tests.services.scheduler.scheduler_kit import make_cluster
from tests.services.scheduler.test_scheduler import make_report
from tidal.schemas.messages import ReqReport, RouteRequest


def _waiting(c: LiveCluster, now: float) -> list[str]:
    return [r.req_id for inst in c.view(now).instances for r in inst.waiting]


def test_a_routed_request_that_finished_unseen_stops_counting_at_the_next_report() -> None:
    c = make_cluster()
    now = time.time()
    for i in (0, 1):
        assert c.on_report(make_report(f"inst-{i}", i, "aggregated"))
    ask = RouteRequest(req_id="short", model="m", req_class="offline", max_tokens=4,
                       num_prompt_chars=40)  # fmt: skip
    c.route(c.new_request(ask, now), now, ask)
    assert _waiting(c, now) == ["short"]  # routed, in no report yet: counted where it went
    # It ran and ended between two reports: the next report names it as finished.
    idx = c.routed["short"][0]
    rep = msgspec.structs.replace(
        make_report(f"inst-{idx}", idx, "aggregated", seq=2), finished_req_ids=["short"]
    )
    assert c.on_report(rep)
    assert _waiting(c, now) == []  # not for ROUTED_GRACE_S more


def test_the_prompt_length_estimate_learns_characters_per_token_from_reports() -> None:
    c = make_cluster()
    now = time.time()
    for i in (0, 1):
        c.on_report(make_report(f"inst-{i}", i, "aggregated"))
    for k in range(30):  # prompts whose tokens are 2 characters each, as the reports show
        ask = RouteRequest(req_id=f"p{k}", model="m", req_class="online", max_tokens=4,
                           num_prompt_chars=2000)  # fmt: skip
        req = c.new_request(ask, now)
        c.route(req, now, ask)
        idx = c.routed[f"p{k}"][0]
        shown = ReqReport(f"p{k}", "online", "waiting", now, 1000, 4, 0, 0, 0)
        c.on_report(make_report(f"inst-{idx}", idx, "aggregated", seq=k + 2, requests=[shown]))
        c.view(now)
    assert abs(c.chars_per_token - 2.0) < 0.1
    ask = RouteRequest(req_id="new", model="m", req_class="online", max_tokens=4,
                       num_prompt_chars=2000)  # fmt: skip
    assert abs(c.new_request(ask, now).num_prompt_tokens - 1000) < 60


def test_the_policy_sees_the_held_queue_by_class_priority_fifo_within() -> None:
    c = make_cluster()
    now = time.time()
    for rid, prio in (("a", 0), ("b", 0), ("c", 1), ("d", 0), ("e", 1)):
        ask = RouteRequest(req_id=rid, model="m", req_class="offline", max_tokens=8,
                           num_prompt_chars=40, class_name=f"p{prio}", priority=prio)  # fmt: skip
        req = c.new_request(ask, now)
        assert (req.priority, req.class_name) == (prio, f"p{prio}")
        c.held[rid] = Held(req, None, ask, now)  # type: ignore[arg-type]
    assert [r.req_id for r in c.view(now).held] == ["c", "e", "a", "b", "d"]
    assert list(c.held) == ["a", "b", "c", "d", "e"]  # the queue itself stays in arrival order
