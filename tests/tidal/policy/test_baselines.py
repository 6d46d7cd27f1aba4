"""Baseline decisions on small hand-built states."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy import InstanceRole, PolicyContext, Slo, make_policy
from tidal.policy.base import RouteAction
from tidal.policy.baselines.chunked import MAX_REPEAT, chunked_plan
from tidal.policy.state import ClusterView, InstanceState, Phase, ReqState
from tidal.schemas.enums import RequestClass

SLO = Slo(1.0, 0.1)


def make_instance(iid: int = 0, blocks: int = 100, chunk: int = 64, role=InstanceRole.AGGREGATED):  # type: ignore[no-untyped-def]
    return InstanceState(
        instance_id=iid,
        role=role,
        chunk_size=chunk,
        max_batch_reqs=8,
        block_size=16,
        num_blocks=blocks,
        num_free_blocks=blocks,
        step_model=LinearStepModel(
            base_s=0.01, per_token_s=0.0, per_ctx_token_s=0.0, per_attn_pair_s=0.0
        ),
        kv_bytes_per_token=1.0,
        pcie_bytes_per_s=1.0,
    )


def make_request(
    rid: str,
    inst: InstanceState,
    *,
    prompt: int = 32,
    done: int = 0,
    out: int = 0,
    online: bool = True,
    waiting: bool = False,
) -> ReqState:
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    r = ReqState(rid, cls, 0.0, prompt, 100, SLO if online else None)
    r.instance_id = inst.instance_id
    r.num_output_tokens = out
    r.num_computed_tokens = done
    if waiting:
        r.phase = Phase.WAITING
        inst.waiting.append(r)
        inst.num_waiting_tokens += r.num_prefill_left
    else:
        r.phase = Phase.RUNNING
        r.num_blocks = inst.blocks_for(done)
        inst.num_free_blocks -= r.num_blocks
        inst.running.append(r)
    return r


def test_decodes_first_then_partial_then_fcfs_chunks() -> None:
    inst = make_instance(chunk=64)
    make_request("d1", inst, done=40, out=9)  # decoding: 32 + 9 - 1 = 40 computed
    make_request("p1", inst, prompt=50, done=20)  # partial prefill, 30 left
    make_request("w1", inst, prompt=100, waiting=True)
    make_request("w2", inst, prompt=10, waiting=True)
    plan = chunked_plan(inst)
    assert plan.decode == ("d1",)
    # 64 - 1 decode = 63: p1 gets its 30, w1 gets 33; w2 waits (FCFS, no budget left).
    assert dict(plan.prefill) == {"p1": 30, "w1": 33}
    assert plan.max_repeat == 1


def test_decode_only_plan_may_repeat() -> None:
    inst = make_instance()
    make_request("d1", inst, done=40, out=9)
    plan = chunked_plan(inst)
    assert plan.decode == ("d1",) and plan.max_repeat == MAX_REPEAT


def test_out_of_blocks_preempts_the_latest_offline() -> None:
    inst = make_instance(blocks=5)
    make_request("a", inst, done=48, out=17)  # 3 blocks, full: the next token needs a 4th
    make_request("b", inst, done=32, out=1, online=False)  # 2 blocks, full
    plan = chunked_plan(inst)
    # No free block: b (latest, offline) is preempted, a gets b's blocks.
    assert plan.recompute == ("b",) and plan.decode == ("a",)


def test_with_checkpoints_a_checkpointed_victim_is_released_and_decodes_checkpointed() -> None:
    inst = make_instance(blocks=5)
    inst.ckpt_capacity_tokens = 64
    make_request("a", inst, done=48, out=17)  # online: 3 blocks, full; needs a 4th
    b = make_request("b", inst, done=32, out=1, online=False)  # 2 blocks, full
    b.num_checkpointed_tokens = inst.ckpt_tokens = 16
    plan = chunked_plan(inst, checkpoint=True)
    assert plan.release == ("b",) and not plan.recompute and plan.decode == ("a",)
    assert chunked_plan(inst).recompute == ("b",)  # not asked: recompute, as before

    inst = make_instance(blocks=20)
    inst.ckpt_capacity_tokens = 48
    make_request("c", inst, done=32, out=1, online=False)  # 32 new full tokens: fit
    make_request("d", inst, done=40, out=1, online=False)  # 32 more: past the 16 left
    make_request("e", inst, done=40, out=1)  # online: never checkpointed
    plan = chunked_plan(inst, checkpoint=True)
    assert plan.checkpoint == ("c",) and set(plan.decode) == {"c", "d", "e"}
    assert plan.max_repeat == 16  # at least once a block


def test_a_released_request_swaps_in_to_prefill_its_lost_tail() -> None:
    inst = make_instance(blocks=20)
    inst.ckpt_capacity_tokens = 64
    r = ReqState("r", RequestClass.OFFLINE, 0.0, 40, 100, instance_id=0, phase=Phase.SWAPPED)
    r.num_output_tokens, r.num_computed_tokens = 5, 32  # released at 44: 12 lost
    r.num_checkpointed_tokens = inst.ckpt_tokens = 32
    r.is_released = True
    inst.swapped.append(r)
    plan = chunked_plan(inst, checkpoint=True)
    assert plan.swap_in == ("r",) and plan.prefill == {"r": 12} and not plan.decode


def test_out_of_blocks_with_only_online_work_ends_the_newest_never_evicts_it() -> None:
    inst = make_instance(blocks=5)
    make_request("a", inst, done=48, out=17)  # 3 blocks, full: the next token needs a 4th
    make_request("b", inst, done=32, out=1)  # 2 blocks, full; online too
    plan = chunked_plan(inst)
    assert plan.abort_no_kv == ("b",) and not plan.evicts


def test_online_first_protects_online() -> None:
    inst = make_instance(blocks=5)
    make_request("off", inst, done=48, out=17, online=False)
    make_request("on", inst, done=32, out=1)
    plan = chunked_plan(inst, online_first=True, swap_victims=True)
    assert plan.swap_out == ("off",) and plan.decode == ("on",) and not plan.recompute


def test_offline_decode_cap() -> None:
    inst = make_instance()
    for i in range(3):
        make_request(f"on{i}", inst, done=40, out=9)
    for i in range(3):
        make_request(f"off{i}", inst, done=40, out=9, online=False)
    plan = chunked_plan(inst, online_first=True, offline_decode_cap=4)
    assert plan.decode == ("on0", "on1", "on2", "off0")


def test_online_priority_holds_offline_until_prefill_idle() -> None:
    ctx = PolicyContext(2, (InstanceRole.PREFILL, InstanceRole.DECODE), SLO)
    pol = make_policy("online-priority", ctx)
    p, d = make_instance(0, role=InstanceRole.PREFILL), make_instance(1, role=InstanceRole.DECODE)
    cluster = ClusterView([p, d], [], 1e9)
    off = ReqState("x", RequestClass.OFFLINE, 0.0, 10, 5)
    assert pol.route(off, cluster, 0.0).action is RouteAction.HOLD
    cluster.held.append(off)
    make_request("busy", p, waiting=True)
    assert not pol.tick(cluster, 0.0).dispatch  # online work queued: offline waits
    p.waiting.clear()
    assert dict(pol.tick(cluster, 0.0).dispatch) == {"x": 0}
    on = ReqState("y", RequestClass.ONLINE, 0.0, 10, 5, SLO)
    assert pol.route(on, cluster, 0.0).instance_id == 0


def test_pd_places_decode_on_roomiest() -> None:
    roles = (InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.DECODE)
    pol = make_policy("base-pd", PolicyContext(3, roles, SLO))
    insts = [make_instance(i, role=r) for i, r in enumerate(roles)]
    make_request("big", insts[1], done=400, out=5)
    cluster = ClusterView(insts, [], 1e9)
    r = make_request("n", insts[0], done=32, out=1)
    assert pol.place_decode(r, insts[0], cluster, 0.0) == 2
    assert pol.schedule(insts[0], 0.0).decode == ()  # prefill side never decodes


def test_parked_offline_work_waits_for_the_blocks_an_online_prompt_needs() -> None:
    # 10 blocks: an online prompt of 96 tokens half prefilled (3 blocks, 3 more to come), and
    # a released offline request (64 tokens checkpointed, 5 blocks with its next) parked on host
    inst = make_instance(blocks=10, chunk=64)
    make_request("on", inst, prompt=96, done=48)
    off = make_request("off", inst, prompt=60, done=0, online=False, waiting=True)
    inst.waiting.remove(off)
    inst.num_waiting_tokens = 0
    off.phase, off.num_computed_tokens, off.num_output_tokens = Phase.SWAPPED, 64, 5
    off.num_checkpointed_tokens, off.is_released = 64, True
    inst.swapped.append(off)
    inst.num_free_blocks = 6  # 5 for the swap-in + 3 for the prompt do not fit
    plan = chunked_plan(inst, checkpoint=True)
    assert plan.swap_in == () and plan.prefill == {"on": 48}
    inst.num_free_blocks = 8  # both fit
    plan = chunked_plan(inst, checkpoint=True)
    assert plan.swap_in == ("off",) and plan.prefill["on"] == 48
