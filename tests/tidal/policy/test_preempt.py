"""`plan_preemption`: which offline work a preempt signal frees, and how, on hand-built states."""

from __future__ import annotations

import pytest

from tests.tidal.policy.preempt_kit import make_instance
from tidal.policy.preempt import PreemptRefused, plan_preemption, room_for_online
from tidal.policy.state import ClusterView, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass


def make_request(
    rid: str,
    inst: InstanceState,
    done: int,
    *,
    online: bool = False,
    arrival_s: float = 0.0,
    ckpt: int = 0,
    phase: Phase = Phase.RUNNING,
) -> ReqState:
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    r = ReqState(rid, cls, arrival_s, 32, 100, Slo(1.0, 0.1) if online else None)
    r.num_computed_tokens, r.num_output_tokens = done, max(1, done - 31)
    r.num_checkpointed_tokens = ckpt
    r.phase = phase
    if phase is Phase.RUNNING:
        r.num_blocks = inst.blocks_for(done)
        inst.num_free_blocks -= r.num_blocks
        inst.running.append(r)
    else:
        inst.waiting.append(r)
    return r


def test_by_blocks_takes_checkpointed_first_then_the_latest_arrivals() -> None:
    inst = make_instance()
    make_request("on", inst, 64, online=True, arrival_s=9.0)  # never a victim
    make_request("old", inst, 64, arrival_s=1.0)  # 4 blocks
    make_request("new", inst, 64, arrival_s=3.0)  # 4 blocks
    make_request("ck", inst, 70, arrival_s=0.5, ckpt=64)  # 5 blocks, 64 tokens saved
    pre = plan_preemption(inst, num_blocks=8, can_release=True, can_swap=True)
    assert [v.req_id for v in pre.victims] == ["ck", "new"]  # 5 + 4 >= 8
    assert pre.num_blocks == 9
    assert pre.plan.release == ("ck",) and pre.plan.recompute == ("new",)
    assert pre.plan.swap_out == () and not pre.plan.computes
    lost = {v.req_id: v.tokens_lost for v in pre.victims}
    assert lost == {"ck": 70 - 64, "new": 64}  # past the checkpoint; all of it


def test_without_checkpoints_a_checkpointed_request_is_recomputed_or_swapped() -> None:
    inst = make_instance()
    make_request("ck", inst, 70, ckpt=64)
    pre = plan_preemption(inst, req_ids=["ck"], can_release=False, can_swap=True)
    assert pre.plan.recompute == ("ck",) and pre.victims[0].tokens_lost == 70
    pre = plan_preemption(inst, req_ids=["ck"], can_release=False, can_swap=True, swap=True)
    assert pre.plan.swap_out == ("ck",) and pre.victims[0].how == "swap"
    assert pre.victims[0].tokens_lost == 0
    # an engine whose swap is a recompute (sglang) recomputes, and says so
    pre = plan_preemption(inst, req_ids=["ck"], can_swap=False, swap=True)
    assert pre.plan.recompute == ("ck",)


@pytest.mark.parametrize(
    ("req_ids", "num_blocks", "why"),
    [
        (["on"], 0, "online work is never preempted"),
        (["off", "on"], 0, "online work is never preempted"),
        (["ghost"], 0, "not on this instance"),
        (["queued"], 0, "holds no GPU KV here (waiting)"),
        ([], 9, "holds 4 KV blocks, fewer than the 9 asked for"),
        ([], 0, "name req_ids, or num_blocks >= 1"),
    ],
)
def test_refusals_name_the_reason(req_ids: list[str], num_blocks: int, why: str) -> None:
    inst = make_instance()
    make_request("on", inst, 64, online=True)
    make_request("off", inst, 64)
    make_request("queued", inst, 0, phase=Phase.WAITING)
    with pytest.raises(PreemptRefused, match=why.replace("(", r"\(").replace(")", r"\)")):
        plan_preemption(inst, req_ids=req_ids, num_blocks=num_blocks, can_release=True)


def test_room_for_online_only_when_no_instance_has_it_and_offline_work_can_make_it() -> None:
    a, b = make_instance(10, 0), make_instance(10, 1)
    view = ClusterView([a, b], [], 1.0)
    new = ReqState("new", RequestClass.ONLINE, 5.0, 60, 10, Slo(1.0, 0.1))  # 4 blocks
    make_request("hog", a, 112, online=True)  # 7 blocks: 3 free
    make_request("off", b, 96)  # 6 blocks: 4 free, room enough
    assert room_for_online(new, view, [0, 1]) is None
    make_request("off2", b, 16)  # 1 more block: 3 free, and 7 offline
    assert room_for_online(new, view, [0, 1]) == (1, 1)  # free 1 block on b
    assert room_for_online(new, view, [0]) is None  # a has online work only
    make_request("waiting", b, 0, online=True, phase=Phase.WAITING)  # 32 more tokens first
    assert room_for_online(new, view, [0, 1]) == (1, 3)  # (60 + 32 + 1) tokens: 6 blocks
    offline = ReqState("bg", RequestClass.OFFLINE, 5.0, 60, 10)
    assert room_for_online(offline, view, [0, 1]) is None  # only for online requests
