"""Ordered request classes inside an instance, on hand-built `InstanceState`s: the waiting list
highest priority first (and so every policy's admission), a higher class evicting a lower one
when KV is full (`class_preemption`), never an equal or higher one, and the preempt signal's
`below_priority` (`plan_preemption`, `room_for_online`)."""

from __future__ import annotations

import pytest

from tests.tidal.policy.preempt_kit import make_instance
from tidal.policy.base import PolicyContext
from tidal.policy.class_preempt import class_preemption
from tidal.policy.preempt import PreemptRefused, plan_preemption, room_for_online
from tidal.policy.registry import make_policy
from tidal.policy.state import (
    ClusterView,
    InstanceRole,
    InstanceState,
    Phase,
    ReqState,
    Slo,
    order_waiting,
)
from tidal.schemas.enums import RequestClass

CHUNK = 256  # tokens per step on these instances (test_preempt's take 64)


def req(
    rid: str,
    inst: InstanceState,
    priority: int,
    *,
    done: int = 0,
    online: bool = True,
    arrival_s: float = 0.0,
    prompt: int = 64,
) -> ReqState:
    """A request of class `priority`: running with `done` tokens of KV, or waiting (done=0)."""
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    r = ReqState(rid, cls, arrival_s, prompt, 100, Slo(1.0, 0.1) if online else None)
    r.priority = priority
    r.instance_id = 0
    if done:
        r.num_computed_tokens, r.num_output_tokens = done, max(1, done - prompt + 1)
        r.phase = Phase.RUNNING
        r.num_blocks = inst.blocks_for(done)
        inst.num_free_blocks -= r.num_blocks
        inst.running.append(r)
    else:
        r.phase = Phase.WAITING
        inst.waiting.append(r)
        order_waiting(inst.waiting, len(inst.waiting) - 1)
        inst.num_waiting_tokens += r.num_prefill_left
    return r


def test_the_waiting_list_is_highest_priority_first_fifo_within_a_priority() -> None:
    inst = make_instance(20, chunk_size=CHUNK)
    for rid, p in (("s1", 1), ("b1", 0), ("i1", 2), ("s2", 1), ("i2", 2), ("b2", 0)):
        req(rid, inst, p, online=p > 0)
    assert [r.req_id for r in inst.waiting] == ["i1", "i2", "s1", "s2", "b1", "b2"]
    inst.waiting.reverse()  # any order: one stable sort restores it, FIFO kept within
    order_waiting(inst.waiting)
    assert [r.req_id for r in inst.waiting] == ["i2", "i1", "s2", "s1", "b2", "b1"]


@pytest.mark.parametrize("policy", ["aggregated", "ooco", "taichi", "omniserve", "hygen", "tidal"])
def test_every_policy_prefills_the_higher_class_first(policy: str) -> None:
    """Room for one prompt only: the policy prefills the interactive request whole, before
    the standard one that came first (which at most takes what is left)."""
    inst = make_instance(5, chunk_size=CHUNK)  # 80 tokens: one 64-token prompt
    req("std", inst, 1, arrival_s=0.0)
    req("int", inst, 2, arrival_s=1.0)
    ctx = PolicyContext(1, (InstanceRole.AGGREGATED,), Slo(5.0, 0.5))
    plan = make_policy(policy, ctx).schedule(inst, 2.0)
    assert next(iter(plan.prefill)) == "int" and plan.prefill["int"] == 64
    assert plan.prefill.get("std", 0) <= 16


def test_a_higher_class_evicts_a_lower_slo_class_when_kv_is_full() -> None:
    inst = make_instance(12, chunk_size=CHUNK)
    req("off", inst, 0, done=32, online=False)  # 2 blocks, best effort: goes first
    req("std_old", inst, 1, done=64, arrival_s=1.0)  # 4 blocks
    req("std_new", inst, 1, done=64, arrival_s=2.0)  # 4 blocks
    req("int_run", inst, 2, done=30, arrival_s=0.5, prompt=20)  # 2 blocks: never a victim
    req("int", inst, 2, arrival_s=3.0, prompt=100)  # needs 7 blocks (101 tokens), 0 free
    pre = class_preemption(inst)
    assert pre is not None
    # offline first, then the lower class's latest arrival, until 7 blocks: 2 + 4 + 4
    assert [v.req_id for v in pre.victims] == ["off", "std_new", "std_old"]
    assert pre.plan.recompute == ("off", "std_new", "std_old") and not pre.plan.computes
    assert pre.plan.evict_below is None  # for a request waiting here: the interpreter checks


def test_a_lower_class_is_evicted_only_as_far_as_needed() -> None:
    inst = make_instance(12, chunk_size=CHUNK)
    req("std_old", inst, 1, done=60, arrival_s=1.0, prompt=40)  # decoding, room: needs none
    req("low", inst, 0, done=64, arrival_s=0.0)  # an SLO class below standard: first
    req("int", inst, 2, prompt=40)  # 3 blocks; 4 free
    assert class_preemption(inst) is None  # it fits: nothing is evicted
    req("fill", inst, 2, done=60, prompt=40)  # now 0 free
    pre = class_preemption(inst)
    assert pre is not None and [v.req_id for v in pre.victims] == ["low"]


def test_never_an_equal_or_higher_class() -> None:
    inst = make_instance(8, chunk_size=CHUNK)
    req("std", inst, 1, done=60, prompt=40)
    req("int", inst, 2, done=60, prompt=40)  # decoding with room in its last block
    req("std2", inst, 1, prompt=100)  # waits for 7 blocks; only its equal and a higher run
    assert class_preemption(inst) is None
    inst2 = make_instance(8, chunk_size=CHUNK)
    req("off", inst2, 0, done=128, online=False)  # best effort alone: the policy's rule decides
    req("int", inst2, 2, prompt=100)
    assert class_preemption(inst2) is None


def test_nothing_when_the_lower_classes_cannot_cover_the_shortfall() -> None:
    inst = make_instance(8, chunk_size=CHUNK)
    req("int_run", inst, 2, done=96)  # 6 blocks
    req("std", inst, 1, done=32)  # 2 blocks
    req("int", inst, 2, prompt=100)  # 7 blocks: evicting std frees only 2
    assert class_preemption(inst) is None


def test_signal_below_priority_preempts_lower_online_work_after_offline() -> None:
    inst = make_instance(20, chunk_size=CHUNK)
    req("off", inst, 0, done=32, online=False)  # 2 blocks
    req("std", inst, 1, done=64, arrival_s=1.0)  # 4 blocks
    req("int", inst, 2, done=64)
    with pytest.raises(PreemptRefused, match="offline work here holds 2 KV blocks"):
        plan_preemption(inst, num_blocks=5)  # default: offline only, as before
    pre = plan_preemption(inst, num_blocks=5, below_priority=2, can_swap=True, swap=True)
    assert [v.req_id for v in pre.victims] == ["off", "std"]
    assert pre.plan.swap_out == ("off",) and pre.plan.recompute == ("std",)  # online: recompute
    assert pre.plan.evict_below == 2
    with pytest.raises(PreemptRefused, match="priority 2, not below 2"):
        plan_preemption(inst, req_ids=["int"], below_priority=2)
    with pytest.raises(PreemptRefused, match="never preempted"):
        plan_preemption(inst, req_ids=["std"])
    assert plan_preemption(inst, req_ids=["std"], below_priority=2).plan.recompute == ("std",)


def test_room_for_online_counts_lower_classes_for_a_higher_request() -> None:
    inst = make_instance(8, chunk_size=CHUNK)
    req("std", inst, 1, done=96)  # 6 blocks
    req("int", inst, 2, done=32)  # 2 blocks
    view = ClusterView([inst], [], 1e9)
    incoming = ReqState("new", RequestClass.ONLINE, 0.0, 64, 10, Slo(1.0, 0.1))
    incoming.priority = 1  # standard: nothing below it runs here
    assert room_for_online(incoming, view, [0]) is None
    incoming.priority = 2  # interactive: standard's 6 blocks may go
    assert room_for_online(incoming, view, [0]) == (0, 5)


def test_a_higher_class_running_short_of_kv_evicts_a_lower_one() -> None:
    inst = make_instance(8, chunk_size=CHUNK)
    req("std", inst, 1, done=60, prompt=40)  # 4 blocks, room left
    req("int", inst, 2, done=64, prompt=40)  # 4 blocks, full: its next token needs one
    pre = class_preemption(inst)
    assert pre is not None and [v.req_id for v in pre.victims] == ["std"]
