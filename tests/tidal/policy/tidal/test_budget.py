"""The strict step's latency budget held to the online requests' TPOT room
(`tidal.policy.tidal.budget`), alone and inside the `tidal` policy's strict step."""

from __future__ import annotations

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.batch_shape import add_prefill, decode_shape
from tidal.policy.registry import make_policy
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.policy.tidal.budget import strict_step_budget, tpot_room_s
from tidal.schemas.enums import RequestClass

SLO = Slo(2.0, 0.05)
# 10 ms a step, 0.1 ms a prefill token: a 512-token chunk alone is 61 ms
MODEL = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


def online(rid: str, first_s: float, out: int, total: int, ctx: int = 400) -> ReqState:
    r = ReqState(rid, RequestClass.ONLINE, first_s - 0.1, ctx - out + 1, total, SLO)
    r.phase, r.num_computed_tokens, r.num_output_tokens = Phase.RUNNING, ctx, out
    r.first_token_s = r.last_token_s = first_s
    r.num_blocks = -(-ctx // 16)
    return r


def offline_prompt(rid: str, n: int = 2000) -> ReqState:
    r = ReqState(rid, RequestClass.OFFLINE, 0.0, n, 100)
    r.phase = Phase.WAITING
    return r


def strict(running: list[ReqState], waiting: list[ReqState]) -> InstanceState:
    inst = InstanceState(1, InstanceRole.STRICT, 512, 256, 16, 10_000, 9_000, MODEL, 1.0, 1e9)
    inst.running, inst.waiting = running, waiting
    inst.num_waiting_tokens = sum(r.num_prefill_left for r in waiting)
    return inst


def test_room_is_what_the_remaining_tokens_may_take() -> None:
    # first token at 10.0 s, 11 tokens in all, target 50 ms: the last may come at 10.5 s.
    r = online("a", 10.0, out=1, total=11)
    assert tpot_room_s(r, 10.2, 0.05) == pytest.approx(0.03)  # 0.3 s left over 10 tokens
    r.num_output_tokens = 6
    assert tpot_room_s(r, 10.2, 0.05) == pytest.approx(0.06)  # 0.3 s over the last 5
    assert tpot_room_s(r, 10.7, 0.05) == pytest.approx(-0.04)  # already past: negative room


def test_no_room_figure_without_a_first_token_or_a_token_left() -> None:
    r = online("a", 10.0, out=11, total=11)
    assert tpot_room_s(r, 10.2, 0.05) is None  # nothing left to make
    r = online("b", 10.0, out=1, total=1)
    assert tpot_room_s(r, 10.2, 0.05) is None  # one token in all: no TPOT
    r = online("c", 10.0, out=1, total=20)
    r.first_token_s = None
    assert tpot_room_s(r, 10.2, 0.05) is None


def test_budget_is_the_fraction_until_a_request_is_pressed() -> None:
    fresh = online("a", 10.0, out=1, total=100)
    inst = strict([fresh], [])
    assert strict_step_budget(inst, 10.0, 0.05, 0.8, 0.9) == pytest.approx(0.04)
    # a 16-token request whose hand-off took 200 ms: 15 * 45 ms - 0.2 s over 15 steps
    late = online("b", 10.0, out=1, total=16)
    inst.running.append(late)
    got = strict_step_budget(inst, 10.2, 0.05, 0.8, 0.9)
    assert got == pytest.approx((15 * 0.045 - 0.2) / 15)
    # offline decodes have no TPOT to keep
    off = ReqState("c", RequestClass.OFFLINE, 0.0, 100, 100)
    off.phase, off.num_computed_tokens, off.num_output_tokens = Phase.RUNNING, 101, 1
    off.first_token_s = 0.0
    assert strict_step_budget(strict([off], []), 50.0, 0.05, 0.8, 0.9) == pytest.approx(0.04)


def test_bad_target_is_refused() -> None:
    roles = (InstanceRole.RELAXED, InstanceRole.STRICT)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="strict_tpot_target"):
            make_policy("tidal", PolicyContext(2, roles, SLO, {"strict_tpot_target": bad}))


def _plan_prefill(first_s: float, now: float) -> int:
    ctx = PolicyContext(2, (InstanceRole.RELAXED, InstanceRole.STRICT), SLO, {"cpu_offload": False})
    pol = make_policy("tidal", ctx)
    inst = strict([online("a", first_s, out=1, total=16)], [offline_prompt("p")])
    plan = pol.schedule(inst, now)
    assert plan.decode == ("a",)  # the online decode runs either way
    return sum(plan.prefill.values())


def test_strict_step_prefills_offline_only_in_what_the_online_tpot_leaves() -> None:
    # Just pushed with its first token now: 40 ms budget, 10.1 ms of decode, 299 prefill tokens.
    fresh = _plan_prefill(10.0, 10.0)
    assert fresh == 299
    # The hand-off took 200 ms: (15 * 45 ms - 0.2 s) / 15 = 31.7 ms, 215 prefill tokens.
    late = _plan_prefill(10.0, 10.2)
    assert late == 215
    # 600 ms gone: 5 ms a step left, less than the decode alone: no offline work.
    assert _plan_prefill(10.0, 10.6) == 0


def test_a_slower_instance_gets_a_budget_its_real_steps_keep() -> None:
    # Steps measured at twice the model (two engines on one core): the budget is divided by 2,
    # so the planned step, at twice its predicted time, stays within 0.8 x the TPOT SLO.
    ctx = PolicyContext(2, (InstanceRole.RELAXED, InstanceRole.STRICT), SLO, {"cpu_offload": False})
    pol = make_policy("tidal", ctx)
    got = {}
    for scale in (1.0, 2.0):
        inst = strict([online("a", 10.0, out=1, total=100)], [offline_prompt("p")])
        inst.step_time_scale = scale
        assert strict_step_budget(inst, 10.0, 0.05, 0.8, 0.9) == pytest.approx(0.04 / scale)
        plan = pol.schedule(inst, 10.0)
        assert plan.decode == ("a",)
        n = sum(plan.prefill.values())
        real_s = scale * MODEL.step_s(add_prefill(decode_shape([400]), n, 0))
        got[scale] = (n, real_s)
    assert got[1.0][0] == 299  # as before: the model's time is the step's
    assert got[1.0][1] <= 0.04 + 1e-9
    # twice as slow: (20 ms - 10.04 ms) / 0.1 ms = 99 tokens; 2 x 19.94 ms <= 40 ms
    assert got[2.0][0] == 99
    assert got[2.0][1] <= 0.04 + 1e-9
    # without the correction, those 299 tokens would have taken 2 x 40 ms: twice the budget
    assert 2.0 * MODEL.step_s(add_prefill(decode_shape([400]), 299, 0)) > 0.079
