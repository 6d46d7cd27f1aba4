"""The interpreter's eviction-by-class rule on the sim engine through the live executor: an
online request is evicted only for an online request of a higher priority on the instance
(waiting, or running) or on its way (a plan's `evict_below`, the preempt signal's), never for an
equal or higher one, and never offloaded or checkpointed."""

from __future__ import annotations

import pytest

from tidal.engine.api import EngineRequest, RequestClass, SamplingParams
from tidal.engine.executor import execute
from tidal.engine.sim.engine import SimEngine, SimEngineConfig
from tidal.plan import EngineCapabilities, PlanRefused, RefusalReason, StepPlan, check_plan

ON = RequestClass.ONLINE


def make_engine(running: dict[str, int], waiting: dict[str, int] | None = None) -> SimEngine:
    """Requests (req_id -> priority) running (prefilled, decoding), then others waiting."""
    eng = SimEngine(SimEngineConfig(tokenizer="bytes", num_kv_blocks=64, max_model_len=512))
    sp = SamplingParams(max_tokens=50)
    for i, (rid, p) in enumerate(running.items()):
        eng.add(EngineRequest(rid, [5] * 40, sp, ON, float(i), priority=p))
    for _ in range(2):
        eng.step()
    for rid, p in (waiting or {}).items():
        eng.add(EngineRequest(rid, [5] * 40, sp, ON, 9.0, priority=p))
    return eng


def status(eng: SimEngine) -> dict[str, str]:
    return {s.req_id: s.status for s in eng.snapshot()}


def test_a_lower_class_is_recomputed_for_a_higher_one_waiting() -> None:
    eng = make_engine({"std": 1}, {"int": 2})
    out = execute(eng, StepPlan(recompute=("std",)))
    assert out.num_recomputed == 1 and status(eng)["std"] == "waiting"
    assert {s.req_id: s.priority for s in eng.snapshot()} == {"std": 1, "int": 2}
    eng.check_integrity()


def test_or_for_a_higher_one_running() -> None:
    eng = make_engine({"std": 1, "int": 2})  # int short of KV for its next token, say
    execute(eng, StepPlan(recompute=("std",)))
    assert status(eng) == {"std": "waiting", "int": "running"}


@pytest.mark.parametrize(
    ("running", "waiting", "victim", "why"),
    [
        ({"std": 1}, {}, "std", "the highest is 1"),  # itself alone
        ({"std": 1}, {"std2": 1}, "std", "priority 1"),  # only an equal class waits
        ({"std": 1, "int": 2}, {"int2": 2}, "int", "priority 2"),  # its own class
        ({"int": 2}, {"std": 1}, "int", "priority 2"),  # a lower class waits
    ],
)
def test_never_for_an_equal_or_lower_class_or_for_nobody(
    running: dict[str, int], waiting: dict[str, int], victim: str, why: str
) -> None:
    eng = make_engine(running, waiting)
    before = eng.snapshot()
    with pytest.raises(PlanRefused, match=why) as err:
        execute(eng, StepPlan(recompute=(victim,)))
    assert err.value.reason is RefusalReason.ONLINE_EVICTION
    assert eng.snapshot() == before


def test_evict_below_makes_room_for_a_request_on_its_way() -> None:
    eng = make_engine({"std": 1})  # the preempt signal comes before the route
    with pytest.raises(PlanRefused, match="priority 1"):
        execute(eng, StepPlan(recompute=("std",), evict_below=1))  # not below 1
    execute(eng, StepPlan(recompute=("std",), evict_below=2))
    assert status(eng)["std"] == "waiting"


def test_online_work_is_never_offloaded_or_checkpointed_by_a_plan() -> None:
    caps = EngineCapabilities(cpu_attention=True, kv_checkpoint=True)
    for plan in (StepPlan(offload=("std",)), StepPlan(checkpoint=("std",))):
        with pytest.raises(PlanRefused) as err:  # though a higher class is here
            check_plan(plan, caps, lambda rid: True, lambda rid: 1, lambda: 3)
        assert err.value.reason is RefusalReason.ONLINE_EVICTION
    check_plan(StepPlan(swap_out=("std",)), caps, lambda rid: True, lambda rid: 1, lambda: 3)
    with pytest.raises(PlanRefused, match="knows no priorities"):  # a side without them
        check_plan(StepPlan(swap_out=("std",)), caps, lambda rid: True)
