"""The `hygen` policy's step on states the two-phase scheduler alone cannot progress."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass

SLO = Slo(1.0, 0.05)


def _inst(num_blocks: int) -> InstanceState:
    model = LinearStepModel()
    agg = InstanceRole.AGGREGATED
    return InstanceState(0, agg, 512, 256, 16, num_blocks, num_blocks, model, 1, 1e9)


def _policy():  # type: ignore[no-untyped-def]
    return make_policy("hygen", PolicyContext(1, (InstanceRole.AGGREGATED,), SLO, {}, seed=0))


def _decoding(rid: str, online: bool, ctx: int, inst: InstanceState) -> ReqState:
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    r = ReqState(rid, cls, 0.0, ctx, 100, SLO if online else None, instance_id=0)
    r.phase, r.num_output_tokens, r.num_computed_tokens = Phase.RUNNING, 1, ctx
    r.num_blocks = inst.blocks_for(ctx)  # full blocks: the next token needs a new one
    inst.running.append(r)
    inst.num_free_blocks -= r.num_blocks
    return r


def test_online_decodes_that_outgrow_kv_end_the_newest_online_never_evict_it() -> None:
    inst = _inst(8)
    _decoding("on-a", True, 64, inst)  # 4 blocks
    _decoding("on-b", True, 64, inst)  # 4 blocks: no block left for either next token
    plan = _policy().schedule(inst, 0.0)
    # vLLM would recompute on-b; Tidal's plan contract never evicts online work: it ends.
    assert plan.abort_no_kv == ("on-b",) and not plan.evicts
    assert not plan.decode


def test_offline_kv_goes_first_and_is_swapped_not_dropped() -> None:
    inst = _inst(8)
    _decoding("on-a", True, 64, inst)
    _decoding("off-a", False, 64, inst)
    plan = _policy().schedule(inst, 0.0)
    assert plan.swap_out == ("off-a",)  # state retained (§4.1)
    assert not plan.recompute


def test_no_new_offline_prompt_while_offline_kv_is_swapped_out() -> None:
    inst = _inst(100)
    swapped = ReqState("off-s", RequestClass.OFFLINE, 0.0, 64, 100, None, instance_id=0)
    swapped.phase, swapped.num_output_tokens, swapped.num_computed_tokens = Phase.SWAPPED, 1, 64
    inst.swapped.append(swapped)
    new = ReqState("off-new", RequestClass.OFFLINE, 0.0, 64, 100, None, instance_id=0)
    new.phase = Phase.WAITING
    inst.waiting.append(new)
    plan = _policy().schedule(inst, 0.0)
    assert "off-new" not in plan.prefill
    assert plan.swap_in == ("off-s",)


def test_online_prefill_budgeted_reaches_the_step() -> None:
    # 10 ms + 0.1 ms per token: the 30 ms budget holds 200 tokens.
    model = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)

    def plan_for(budgeted: bool) -> dict[str, int]:
        inst = InstanceState(0, InstanceRole.AGGREGATED, 512, 256, 16, 1000, 1000, model, 1, 1e9)
        r = ReqState("on-p", RequestClass.ONLINE, 0.0, 400, 10, SLO, instance_id=0)
        r.phase = Phase.WAITING
        inst.waiting.append(r)
        params = {"latency_budget_s": 0.03, "online_prefill_budgeted": budgeted}
        ctx = PolicyContext(1, (InstanceRole.AGGREGATED,), SLO, params, seed=0)
        return dict(make_policy("hygen", ctx).schedule(inst, 0.0).prefill)

    assert plan_for(True) == {"on-p": 200}
    assert plan_for(False) == {"on-p": 400}
