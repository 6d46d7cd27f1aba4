"""The `tidal` policy's plans on a full KV pool (`tidal.policy.tidal.liveness`): a strict
instance whose decodes all need a block frees one (offline work first, an online request only
when none is left), decodes wait for the one that can finish, prompts longer than the pool end,
and an offline request the gate would hold for ever still reaches an idle instance."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext, StepPlan
from tidal.policy.registry import make_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.policy.tidal.liveness import keep_one_finishing, strict_unstick
from tidal.schemas.enums import RequestClass

SLO = Slo(2.0, 0.05)
MODEL = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)
ONLINE, OFFLINE = RequestClass.ONLINE, RequestClass.OFFLINE


def decoding(rid: str, klass: RequestClass, ctx: int, out: int, blocks: int) -> ReqState:
    """A decode with `ctx` tokens of KV in `blocks` 16-token blocks, `out` tokens still to make."""
    r = ReqState(rid, klass, 0.0, ctx - 1, out + 1, SLO if klass is ONLINE else None)
    r.phase, r.num_computed_tokens, r.num_output_tokens = Phase.RUNNING, ctx, 1
    r.num_blocks = blocks
    r.first_token_s = 0.0
    r.instance_id = 1
    return r


def instance(role: InstanceRole, num_blocks: int, *running: ReqState) -> InstanceState:
    used = sum(r.num_blocks for r in running)
    inst = InstanceState(1, role, 512, 256, 16, num_blocks, num_blocks - used, MODEL, 1e3, 1e9)
    inst.running = list(running)
    return inst


def policy():  # type: ignore[no-untyped-def]
    ctx = PolicyContext(2, (InstanceRole.RELAXED, InstanceRole.STRICT), SLO, {})
    return make_policy("tidal", ctx)


def test_a_strict_pool_full_of_online_decodes_ends_the_newest_one() -> None:
    # 64 tokens in 4 blocks each, every block taken: each next token needs a fifth block.
    inst = instance(
        InstanceRole.STRICT,
        8,
        decoding("a", ONLINE, 64, 10, 4),
        decoding("b", ONLINE, 64, 10, 4),
    )
    plan = policy().schedule(inst, 0.0)
    assert plan == StepPlan(abort_no_kv=("b",))  # OOCO's step alone is empty: stuck for ever


def test_offline_work_gives_up_its_blocks_before_any_online_request() -> None:
    run = (
        decoding("a", ONLINE, 64, 10, 4),
        decoding("x", OFFLINE, 32, 10, 2),
        decoding("b", ONLINE, 32, 10, 2),
    )
    assert policy().schedule(instance(InstanceRole.STRICT, 8, *run), 0.0) == StepPlan(
        swap_out=("x",)
    )
    inst = instance(InstanceRole.STRICT, 8, *run)
    assert strict_unstick(inst, offload=True) == StepPlan(offload=("x",))


def test_a_request_holding_the_whole_pool_ends_rather_than_cycling() -> None:
    inst = instance(InstanceRole.STRICT, 4, decoding("x", OFFLINE, 64, 10, 4))
    assert policy().schedule(inst, 0.0) == StepPlan(abort_no_kv=("x",))


def test_no_abort_while_a_decode_has_room_in_its_last_block() -> None:
    inst = instance(
        InstanceRole.STRICT,
        8,
        decoding("a", ONLINE, 64, 10, 4),
        decoding("b", ONLINE, 60, 10, 4),  # 4 tokens of room left
    )
    plan = policy().schedule(inst, 0.0)
    assert plan.abort_no_kv == ()
    assert plan.decode == ("b",)


def test_decodes_wait_for_the_one_that_can_finish() -> None:
    # 2 blocks free; a needs 1 more block to finish, b needs 6: b would take a's block.
    a = decoding("a", ONLINE, 64, 10, 4)
    b = decoding("b", ONLINE, 64, 90, 4)
    inst = instance(InstanceRole.STRICT, 10, a, b)
    inst.num_free_blocks = 1
    plan = keep_one_finishing(inst, StepPlan(decode=("b", "a"), max_repeat=4))
    assert plan == StepPlan(decode=("a",))
    # The step gave the free block to b (a left out): a takes it back, with no offline prefill.
    plan = keep_one_finishing(inst, StepPlan(prefill={"p": 16}, decode=("b",)))
    assert plan == StepPlan(decode=("a",))
    inst.num_free_blocks = 2  # a block beyond a's: b takes it
    assert keep_one_finishing(inst, StepPlan(decode=("b", "a"))).decode == ("a", "b")
    inst.num_free_blocks = 7  # room for both to finish: the plan is left as it is
    roomy = StepPlan(decode=("b", "a"), max_repeat=4)
    assert keep_one_finishing(inst, roomy) is roomy


def test_prompts_longer_than_the_pool_end_on_a_relaxed_instance() -> None:
    long_online = ReqState("on", ONLINE, 0.0, 200, 10, SLO)
    long_online.phase = Phase.WAITING
    inst = instance(InstanceRole.RELAXED, 8)  # 128 tokens
    inst.waiting = [long_online]
    inst.num_waiting_tokens = 200
    assert policy().schedule(inst, 0.0) == StepPlan(abort_no_kv=("on",))
    long_offline = ReqState("off", OFFLINE, 0.0, 200, 10)
    long_offline.phase = Phase.WAITING
    inst.waiting = [long_offline]
    assert policy().schedule(inst, 0.0) == StepPlan(abort_no_kv=("off",))


def test_an_idle_instance_takes_the_offline_request_the_gate_refuses() -> None:
    pol = policy()
    relaxed = instance(InstanceRole.RELAXED, 8)
    relaxed.instance_id = 0
    strict = instance(InstanceRole.STRICT, 8)
    # 100 prompt tokens fit the 128 free, the gate's expected output does not: held for ever.
    held = ReqState("off", OFFLINE, 0.0, 100, 10)
    view = ClusterView([relaxed, strict], [], 1e9)
    pol.route(held, view, 0.0)
    held.phase = Phase.HELD
    view.held.append(held)
    assert pol.tick(view, 0.0).dispatch == {"off": 0}
    relaxed.waiting = [ReqState("busy", OFFLINE, 0.0, 10, 10)]  # offline work there: it waits
    assert pol.tick(view, 0.0).dispatch == {}


def test_an_online_decode_waits_on_its_relaxed_instance_until_it_can_finish() -> None:
    pol = policy()
    # The strict instance: 10 blocks, a holds 4 and needs 1 more to finish; 6 free.
    strict = instance(InstanceRole.STRICT, 10, decoding("a", ONLINE, 64, 10, 4))
    relaxed = instance(InstanceRole.RELAXED, 64)
    relaxed.instance_id = 0
    view = ClusterView([relaxed, strict], [], 1e9)
    # b's context (64 tokens + 1) fits the 6 free blocks; to finish it needs 6, a needs 1.
    b = decoding("b", ONLINE, 64, 30, 4)
    b.instance_id = 0
    relaxed.running = [b]
    relaxed.num_free_blocks -= 4
    assert pol.place_decode(b, relaxed, view, 0.0) is None  # parked, KV kept on the relaxed
    assert pol.tick(view, 0.0).migrate == ()
    small = decoding("c", ONLINE, 64, 10, 4)  # one that could finish there waits behind b
    assert pol.place_decode(small, relaxed, view, 0.0) is None
    strict.running = []  # a finished: its blocks are free, b can finish there now
    strict.num_free_blocks = 10
    moves = pol.tick(view, 1.0).migrate
    assert [(m.req_id, m.dst) for m in moves] == [("b", 1)]
    assert pol.tick(view, 1.01).migrate == ()  # asked for: not again at once


def test_a_push_with_room_to_finish_goes_at_once() -> None:
    strict = instance(InstanceRole.STRICT, 64, decoding("a", ONLINE, 64, 10, 4))
    relaxed = instance(InstanceRole.RELAXED, 64)
    relaxed.instance_id = 0
    view = ClusterView([relaxed, strict], [], 1e9)
    assert policy().place_decode(decoding("b", ONLINE, 64, 30, 4), relaxed, view, 0.0) == 1


def test_a_waiting_push_takes_the_blocks_of_an_offline_prefill() -> None:
    # A strict instance prefilling offline work (HyGen's) has 2 blocks left; the push needs 4.
    x = ReqState("x", OFFLINE, 0.0, 200, 10)
    x.phase, x.num_computed_tokens, x.num_blocks, x.instance_id = Phase.RUNNING, 96, 6, 1
    inst = instance(InstanceRole.STRICT, 8, x)
    pushed = decoding("p", ONLINE, 60, 10, 4)
    pushed.phase = Phase.TRANSFER_WAIT
    inst.pending_in = [pushed]
    assert policy().schedule(inst, 0.0) == StepPlan(recompute=("x",))
