"""The default FCFS chunked-prefill planner."""

from __future__ import annotations

import pytest

from tidal.engine.scheduler import FcfsChunkedPlanner, SeqView
from tidal.schemas.enums import RequestClass


def view(
    rid: str, t: float, pending: int, decode: bool = False, kv: bool = False, forced: int = 0
) -> SeqView:
    return SeqView(rid, RequestClass.ONLINE, t, pending, decode, kv or decode, forced)


def test_decodes_first_then_fcfs_chunks_within_budget() -> None:
    planner = FcfsChunkedPlanner(token_budget=20, chunk_size=8)
    seqs = [
        view("late", 3.0, 50),
        view("d1", 0.5, 1, decode=True),
        view("early", 1.0, 30),
        view("d2", 2.0, 1, decode=True),
    ]
    plan = planner.plan(seqs, num_free_blocks=100, block_size=4)
    # 2 decodes, then early gets a chunk of 8, late gets 8 of the remaining 10
    assert plan.num_tokens == {"d1": 1, "d2": 1, "early": 8, "late": 8}
    assert plan.decode == ("d1", "d2") and dict(plan.prefill) == {"early": 8, "late": 8}
    assert plan.total_tokens == 18


def test_a_waiting_request_that_does_not_fit_blocks_later_ones() -> None:
    planner = FcfsChunkedPlanner(token_budget=64, chunk_size=32)
    seqs = [view("big", 1.0, 32), view("small", 2.0, 4)]
    assert planner.plan(seqs, num_free_blocks=3, block_size=4).num_tokens == {}


def test_preempted_chunk_resumes_with_its_size_even_over_budget() -> None:
    planner = FcfsChunkedPlanner(token_budget=8, chunk_size=8)
    seqs = [view("p", 1.0, 40, kv=True, forced=16), view("q", 2.0, 5)]
    assert planner.plan(seqs, 100, 4).num_tokens == {"p": 16}
    with pytest.raises(ValueError):
        FcfsChunkedPlanner(token_budget=0)


def test_online_prefills_go_first_and_may_count_offline_held_blocks() -> None:
    planner = FcfsChunkedPlanner(token_budget=64, chunk_size=16)
    off = SeqView("off", RequestClass.OFFLINE, 0.0, 1, True, True, 0, num_blocks=6)
    waiting_off = SeqView("off2", RequestClass.OFFLINE, 1.0, 8, False, False, 0)
    on = view("on", 2.0, 16)  # 4 blocks of 4: 1 free, 3 from the offline holder
    plan = planner.plan([off, waiting_off, on], num_free_blocks=1, block_size=4)
    # the waiting offline prefill, earlier but offline, may not count an online request's
    assert plan.num_tokens == {"off": 1, "on": 16}
    online_held = view("on-dec", 0.0, 1, decode=True)
    plan = planner.plan([online_held, waiting_off], num_free_blocks=0, block_size=4)
    assert plan.num_tokens == {"on-dec": 1}
