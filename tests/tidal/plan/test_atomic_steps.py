"""Atomic steps: a plan that fails at any stage leaves every request as it was before it (the
one interpreter undoes what ran), shown on the sim engine through the live executor."""

from __future__ import annotations

import pytest

from tidal.engine.api import EngineRequest, RequestClass, SamplingParams
from tidal.engine.executor import execute
from tidal.engine.sim.engine import SimEngine, SimEngineConfig
from tidal.plan import STAGES, PlanRefused, RefusalReason, StepPlan


def make_engine() -> SimEngine:
    eng = SimEngine(SimEngineConfig(tokenizer="bytes", num_kv_blocks=64, max_model_len=512))
    for i, cls in enumerate((RequestClass.OFFLINE,) * 3 + (RequestClass.ONLINE,)):
        eng.add(EngineRequest(f"r{i}", [5] * 40, SamplingParams(max_tokens=50), cls, float(i)))
    for _ in range(3):  # everyone prefilled and decoding
        eng.step()
    eng.swap_out("r2")
    return eng


# swap_out r0, swap_in r2, then a step; the stage named fails
PLAN = StepPlan(recompute=("r1",), swap_out=("r0",), swap_in=("r2",), decode=("r2", "r3"))


@pytest.mark.parametrize("stage", ["swap_out", "swap_in", "step"])
def test_a_failure_at_each_stage_leaves_every_request_as_before(stage: str) -> None:
    eng = make_engine()
    before = {s.req_id: s for s in eng.snapshot() if s.req_id != "r1"}

    real = getattr(eng, stage)
    victim = {"swap_out": "r0", "swap_in": "r2"}.get(stage)

    def fail(*args: object) -> object:
        if stage == "step" or args[0] == victim:  # the undo of other stages still works
            raise RuntimeError(f"injected at {stage}")
        return real(*args)

    setattr(eng, stage, fail)
    with pytest.raises(PlanRefused) as err:
        execute(eng, PLAN)
    assert err.value.stage == stage and err.value.reason is RefusalReason.ENGINE_FAILURE
    after = {s.req_id: s for s in eng.snapshot()}
    # r1's recompute ran first and is deliberate (counted); everyone else is untouched
    assert after["r1"].num_computed_tokens == 0 and after["r1"].status == "waiting"
    assert {k: v for k, v in after.items() if k != "r1"} == before
    eng.check_integrity()


def test_every_stage_is_named() -> None:
    assert STAGES == (
        "abort_no_kv",
        "checkpoint",
        "recompute",
        "release",
        "swap_out",
        "offload",
        "swap_in",
        "recall",
        "step",
    )


def test_an_online_request_is_never_evicted_by_a_plan() -> None:
    eng = make_engine()
    before = eng.snapshot()
    for plan in (StepPlan(recompute=("r3",)), StepPlan(swap_out=("r3",))):
        with pytest.raises(PlanRefused) as err:
            execute(eng, plan)
        assert err.value.reason is RefusalReason.ONLINE_EVICTION
    assert eng.snapshot() == before


def test_an_engine_without_checkpoints_refuses_them_typed() -> None:
    eng = make_engine()  # no checkpoint budget: the sim engine declares no `kv_checkpoint`
    before = eng.snapshot()
    for plan in (StepPlan(checkpoint=("r0",)), StepPlan(release=("r0",), decode=("r3",))):
        with pytest.raises(PlanRefused) as err:
            execute(eng, plan)
        assert err.value.reason is RefusalReason.NO_KV_CHECKPOINT and err.value.stage == ""
    assert eng.snapshot() == before
