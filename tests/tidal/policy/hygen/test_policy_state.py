"""`hygen` as configured in configs/hygen.yaml: Sarathi-Serve's recompute preemption of offline
requests and whole-prompt admission (papers/hygen.md §4.1, §5.1)."""

from __future__ import annotations

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.hygen import HygenConfig
from tidal.policy.registry import make_policy
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass

SLO = Slo(1.0, 0.05)
SARATHI = {"offline_preemption": "recompute", "admit_whole_prompt": True}


def _inst(num_blocks: int) -> InstanceState:
    agg = InstanceRole.AGGREGATED
    return InstanceState(0, agg, 512, 256, 16, num_blocks, num_blocks, LinearStepModel(), 1, 1e9)


def _policy(params: dict[str, object]):  # type: ignore[no-untyped-def]
    ctx = PolicyContext(1, (InstanceRole.AGGREGATED,), SLO, params, seed=0)
    return make_policy("hygen", ctx)


def _req(rid: str, online: bool, prompt: int, inst: InstanceState) -> ReqState:
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    return ReqState(rid, cls, 0.0, prompt, 100, SLO if online else None, instance_id=0)


def _decoding(rid: str, online: bool, ctx: int, inst: InstanceState) -> ReqState:
    r = _req(rid, online, ctx, inst)
    r.phase, r.num_output_tokens, r.num_computed_tokens = Phase.RUNNING, 1, ctx
    r.num_blocks = inst.blocks_for(ctx)  # full blocks: the next token needs a new one
    inst.running.append(r)
    inst.num_free_blocks -= r.num_blocks
    return r


def _waiting(rid: str, online: bool, prompt: int, inst: InstanceState) -> ReqState:
    r = _req(rid, online, prompt, inst)
    r.phase = Phase.WAITING
    inst.waiting.append(r)
    inst.num_waiting_tokens += prompt
    return r


def test_offline_victim_of_online_decode_growth_is_recomputed_not_swapped() -> None:
    inst = _inst(8)
    _decoding("on-a", True, 64, inst)
    _decoding("off-a", False, 64, inst)
    plan = _policy(SARATHI).schedule(inst, 0.0)
    assert plan.recompute == ("off-a",)  # Sarathi-Serve `_preempt`: blocks freed, request requeued
    assert not plan.swap_out


def test_online_prompt_takes_offline_memory_by_recompute_preemption() -> None:
    inst = _inst(40)
    off = _req("off-p", False, 640, inst)  # a prefill holding 20 of its 40 blocks
    off.phase, off.num_computed_tokens, off.num_blocks = Phase.RUNNING, 320, 20
    inst.running.append(off)
    inst.num_free_blocks -= 20
    _waiting("on", True, 400, inst)  # needs 25 blocks; 20 are free
    plan = _policy(SARATHI).schedule(inst, 0.0)
    assert plan.prefill.get("on") == 400
    assert plan.recompute == ("off-p",) and not plan.swap_out


def test_offline_prompt_starts_only_when_its_whole_prompt_fits() -> None:
    inst = _inst(30)  # 480 tokens of KV
    _waiting("off-big", False, 600, inst)  # 38 blocks: a first chunk would fit, the prompt not
    assert "off-big" in _policy({}).schedule(inst, 0.0).prefill  # chunk by chunk (default)
    assert "off-big" not in _policy(SARATHI).schedule(inst, 0.0).prefill


def test_running_prefills_keep_the_rest_of_their_prompt() -> None:
    inst = _inst(40)
    on = _req("on-p", True, 480, inst)  # 30 blocks promised, 10 held so far
    on.phase, on.num_computed_tokens, on.num_blocks = Phase.RUNNING, 160, 10
    inst.running.append(on)
    inst.num_free_blocks -= 10
    _waiting("off-a", False, 64, inst)  # 4 blocks: fits the 10 that are not promised
    _waiting("off-b", False, 160, inst)  # 10 more: would eat the running prefill's blocks
    plan = _policy(SARATHI).schedule(inst, 0.0)
    assert "off-a" in plan.prefill
    assert "off-b" not in plan.prefill


def test_config_rejects_unknown_preemption_mode() -> None:
    with pytest.raises(ValueError):
        HygenConfig(offline_preemption="drop")


def test_offline_decodes_that_fill_the_pool_preempt_the_newest_offline() -> None:
    inst = _inst(8)
    _decoding("off-old", False, 64, inst)  # 4 blocks
    _decoding("off-new", False, 64, inst)  # 4 blocks: no block left for either next token
    plan = _policy(SARATHI).schedule(inst, 0.0)
    assert plan.recompute == ("off-new",)  # Sarathi-Serve: the newest request gives way
    assert not plan.is_empty
