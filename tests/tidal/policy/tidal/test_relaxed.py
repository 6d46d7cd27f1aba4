"""Steps of `tidal` on a latency-relaxed instance (`tidal.policy.tidal.relaxed`): the offline
steps' length cap (`relaxed_step_s`), which of them an arriving online prefill may cut
(`relaxed_uncut_ttft`), and offline prefill topping up an online prefill step (`relaxed_fill`)."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext, StepPlan
from tidal.policy.registry import make_policy
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.policy.tidal.config import TidalConfig
from tidal.policy.tidal.relaxed import keep_uncut, plan_shape
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.workload.mix import SimRequest

SLO = Slo(2.0, 0.05)
# 10 ms a step plus 50 us a token: a 1,000-token chunk takes 60 ms, a 2,000-token one 110 ms.
MODEL = LinearStepModel(base_s=0.01, per_token_s=5e-5, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


def prompt(rid: str, n: int) -> ReqState:
    r = ReqState(rid, RequestClass.OFFLINE, 0.0, n, 32)
    r.phase = Phase.WAITING
    return r


def relaxed(*waiting: ReqState) -> InstanceState:
    inst = InstanceState(0, InstanceRole.RELAXED, 4096, 256, 16, 10_000, 10_000, MODEL, 1e3, 1e9)
    inst.num_layers = 28
    inst.waiting = list(waiting)
    inst.num_waiting_tokens = sum(r.num_prefill_left for r in waiting)
    return inst


def plan_of(inst: InstanceState, **params: Any) -> StepPlan:
    ctx = PolicyContext(2, (InstanceRole.RELAXED, InstanceRole.STRICT), SLO, params)
    return make_policy("tidal", ctx).schedule(inst, 0.0)


def test_relaxed_step_cap_sets_the_offline_prefill_chunk() -> None:
    short = plan_of(relaxed(prompt("a", 3000)), relaxed_step_s=0.06)
    long = plan_of(relaxed(prompt("a", 3000)), relaxed_step_s=0.11)
    # The largest chunk within the cap (to a token: float rounding): 10 ms + 1,000 x 50 us =
    # 60 ms; 110 ms takes 2,000 tokens, half the steps and half the 10 ms overheads.
    assert short.prefill["a"] == pytest.approx(1000, abs=1)
    assert long.prefill["a"] == pytest.approx(2000, abs=1)
    # An `ooco:` section's own cap still wins (it is the same knob under OOCO's name).
    both = plan_of(
        relaxed(prompt("a", 3000)), relaxed_step_s=0.11, ooco={"offline_step_cap_s": 0.06}
    )
    assert both.prefill == short.prefill


def test_default_offline_steps_of_ooco_and_tidal_stay_preemptible() -> None:
    inst = relaxed(prompt("a", 3000))
    ctx = PolicyContext(2, (InstanceRole.RELAXED, InstanceRole.STRICT), SLO, {})
    ooco = make_policy("ooco", ctx).schedule(inst, 0.0)
    tidal = plan_of(relaxed(prompt("a", 3000)))
    # OOCO's 0.4 s cap holds the whole 3,000-token prompt (10 ms + 3,000 x 50 us = 160 ms);
    # tidal's 0.1 s: 1,800 tokens. An online arrival may cut either step at a layer boundary.
    assert ooco.prefill["a"] == pytest.approx(3000, abs=1)
    assert tidal.prefill["a"] == pytest.approx(1800, abs=1)
    assert ooco.layer_cut and tidal.layer_cut


def test_a_short_offline_step_is_left_uncut_a_long_one_stays_preemptible() -> None:
    inst = relaxed(prompt("a", 3000))
    # 0.05 x 2 s TTFT = 100 ms: the 60 ms step is not cut, the 110 ms one is.
    assert not plan_of(inst, relaxed_step_s=0.06, relaxed_uncut_ttft=0.05).layer_cut
    assert plan_of(inst, relaxed_step_s=0.11, relaxed_uncut_ttft=0.05).layer_cut
    assert plan_of(inst, relaxed_step_s=0.06, relaxed_uncut_ttft=0.0).layer_cut  # OOCO's rule


def test_keep_uncut_prices_the_plans_decodes_and_chunks() -> None:
    inst = relaxed(prompt("a", 900))
    d = ReqState("d", RequestClass.OFFLINE, 0.0, 500, 32)
    d.phase, d.num_computed_tokens, d.num_output_tokens = Phase.RUNNING, 501, 1
    inst.running = [d]
    plan = StepPlan(prefill={"a": 900}, decode=("d",), layer_cut=True)
    shape = plan_shape(inst, plan)
    assert (shape.num_prefill_tokens, shape.num_decode_reqs) == (900, 1)
    assert MODEL.step_s(shape) == pytest.approx(0.01 + 901 * 5e-5)
    assert not keep_uncut(inst, plan, 2.0, 0.03).layer_cut  # 55 ms <= 60 ms
    assert keep_uncut(inst, plan, 2.0, 0.025).layer_cut  # 55 ms > 50 ms
    assert keep_uncut(inst, StepPlan(prefill={"a": 900}), 2.0, 0.5) == StepPlan(prefill={"a": 900})


@pytest.mark.parametrize(
    "field,value",
    [("relaxed_step_s", 0.0), ("relaxed_uncut_ttft", -0.1), ("relaxed_uncut_ttft", 1.0)],
)
def test_bad_relaxed_knobs_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        TidalConfig(**{field: value})


def run_one_cut(uncut: float) -> tuple[int, float, float]:
    """An offline prompt on the relaxed instance (one 60 ms step), an online one arriving 30 ms
    into it."""
    setups = [
        InstanceSetup(InstanceRole.RELAXED, 4096, 2000, MODEL, 1e3, num_layers=28),
        InstanceSetup(InstanceRole.STRICT, 512, 2000, MODEL, 1e3, num_layers=28),
    ]
    params = {"relaxed_step_s": 0.0605, "relaxed_uncut_ttft": uncut}
    ctx = PolicyContext(2, (InstanceRole.RELAXED, InstanceRole.STRICT), SLO, params)
    reqs = [
        SimRequest("off", RequestClass.OFFLINE, 0.0, 1000, 2),
        SimRequest("on", RequestClass.ONLINE, 0.03, 200, 2, SLO),
    ]
    rec = Simulator(setups, make_policy("tidal", ctx), check=True, horizon_s=10).run(reqs)
    by = {r.req_id: r for r in rec.requests}
    assert by["on"].first_token_s is not None and by["off"].first_token_s is not None
    return rec.num_layer_preemptions, by["on"].first_token_s, by["off"].first_token_s


def test_in_the_simulator_an_uncut_step_keeps_its_work_and_the_online_prefill_waits() -> None:
    cuts, on_cut, off_cut = run_one_cut(0.0)
    kept, on_kept, off_kept = run_one_cut(0.05)
    assert (cuts, kept) == (1, 0)
    # Cut: the online prefill starts at the next layer boundary after 30 ms, the offline chunk
    # resumes after it from the cut layer (as the engines do: OOCO §3.4.1), in less than its
    # whole step. Kept: the online prefill starts at 60 ms, when the step ends, and the
    # offline prompt's first token comes out then.
    assert on_kept > on_cut
    assert on_kept - 0.03 < 0.05 * SLO.ttft_s + MODEL.step_s(plan_shape_of_prefill(200))
    assert off_kept == pytest.approx(0.06)
    assert on_cut < off_cut < on_cut + MODEL.step_s(plan_shape_of_prefill(1000))


def plan_shape_of_prefill(n: int):  # type: ignore[no-untyped-def]
    inst = relaxed(prompt("x", n))
    return plan_shape(inst, StepPlan(prefill={"x": n}))


def online(rid: str, n: int) -> ReqState:
    r = ReqState(rid, RequestClass.ONLINE, 0.0, n, 8, SLO)
    r.phase = Phase.WAITING
    return r


def test_an_online_prefill_step_is_topped_up_with_offline_prefill_within_the_bound() -> None:
    inst = relaxed(online("on", 500), prompt("a", 3000))
    # Bound min(0.11 s, 0.1 x 2 s): 500 online tokens (35 ms) and then offline up to 110 ms.
    plan = plan_of(inst, relaxed_step_s=0.11, relaxed_uncut_ttft=0.1, relaxed_fill=True)
    assert plan.prefill["on"] == 500
    assert plan.prefill["a"] == pytest.approx(1500, abs=1)
    assert not plan.layer_cut  # an online step is never cut
    assert plan_of(inst, relaxed_step_s=0.11, relaxed_fill=False).prefill == {"on": 500}
    assert plan_of(
        inst, relaxed_step_s=0.11, relaxed_uncut_ttft=0.0, relaxed_fill=True
    ).prefill == {"on": 500}


def test_no_offline_fill_while_online_prompt_tokens_still_wait() -> None:
    # 5,000 online tokens: the 4,096-token chunk is all online, the rest waits for the next step.
    plan = plan_of(relaxed(online("on", 5000), prompt("a", 3000)), relaxed_step_s=0.11)
    assert plan.prefill == {"on": 4096}
    # Two online prompts: both whole in the step, then offline; a third that does not fit
    # whole within the chunk leaves no room for offline work.
    fill = {"relaxed_step_s": 0.15, "relaxed_uncut_ttft": 0.1, "relaxed_fill": True}
    two = plan_of(relaxed(online("o1", 300), online("o2", 200), prompt("a", 3000)), **fill)
    assert (two.prefill["o1"], two.prefill["o2"]) == (300, 200)
    assert two.prefill["a"] > 0
    three = plan_of(
        relaxed(online("o1", 300), online("o2", 3700), online("o3", 500), prompt("a", 3000)),
        **fill,
    )
    assert "a" not in three.prefill
