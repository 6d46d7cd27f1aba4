"""Offline KV checkpoints in the sim engine (emulated, as the torch engine keeps them): the plan
stages (checkpoint, release, swap_in restores), the host budget, and the own planner, which
checkpoints offline requests itself and releases a checkpointed victim instead of recomputing
it; the output is the same as without the preemption."""

from __future__ import annotations

import pytest

from tests.tidal.engine.sim.test_engine import make_engine, make_request, run_to_end
from tidal.engine.api import RequestClass
from tidal.engine.executor import execute
from tidal.engine.sim.engine import SimEngine
from tidal.plan import PlanRefused, RefusalReason, StepPlan

BS = 16
KVB = 23_040  # SimEngineConfig.kv_bytes_per_token
OFF = RequestClass.OFFLINE


def alone() -> list[int]:
    e = make_engine(num_kv_blocks=6, max_model_len=96)
    e.add(make_request("b", prompt_len=20, max_tokens=40, req_class=OFF))
    return run_to_end(e)["b"]


def own_eviction(budget: int) -> tuple[SimEngine, list[int]]:
    """Offline `b` decodes under the own planner until it holds 3 of 6 blocks; online `a`,
    whose prompt needs 4, arrives; both run to the end."""
    e = make_engine(num_kv_blocks=6, max_model_len=96, checkpoint_host_bytes=budget)
    e.add(make_request("b", prompt_len=20, max_tokens=40, req_class=OFF))
    out: list[int] = []
    while e.seqs["b"].num_computed < 2 * BS + 4:
        out += [t for ev in e.step().events for t in ev.token_ids]
        e.check_integrity()
    e.add(make_request("a", prompt_len=3 * BS + 8, max_tokens=4, arrival_s=1.0))
    while e.has_work():
        out += [t for ev in e.step().events if ev.req_id == "b" for t in ev.token_ids]
        e.check_integrity()
    return e, out


def test_the_own_eviction_releases_a_checkpointed_request() -> None:
    ref = alone()
    e, out = own_eviction(1 << 30)
    assert e.num_checkpoint_releases == 1 and e.num_recompute_preemptions == 0
    assert e.num_checkpoint_lost_tokens == 4 and e.num_restored_tokens == 2 * BS
    assert out == ref and e.num_checkpoint_bytes == 0
    bare, out = own_eviction(0)
    assert bare.num_recompute_preemptions == 1 and bare.num_checkpoint_releases == 0
    assert not bare.capabilities.kv_checkpoint and out == ref


def test_the_own_planner_checkpoints_up_to_the_budget_then_stops() -> None:
    e = make_engine(checkpoint_host_bytes=2 * BS * KVB)  # two blocks
    e.add(make_request("b", prompt_len=20, max_tokens=60, req_class=OFF))
    seq = e.seqs["b"]
    while seq.num_computed < 4 * BS:
        before = seq.num_computed  # a step checkpoints the blocks full before it computes
        e.step()
        e.check_integrity()
        assert seq.num_ckpt_tokens == min(before // BS * BS, 2 * BS)
    assert e.num_checkpoint_copied_tokens == 2 * BS and e.checkpoint_room_bytes == 0


def test_plan_stages_checkpoint_release_and_restore() -> None:
    e = make_engine(checkpoint_host_bytes=1 << 30)
    e.add(make_request("b", prompt_len=20, max_tokens=60, req_class=OFF))
    e.add(make_request("a", prompt_len=20, max_tokens=60))
    e.step()
    while e.seqs["b"].num_computed < 2 * BS + 5:
        execute(e, StepPlan(decode=("a", "b"), checkpoint=("b",)))
    with pytest.raises(PlanRefused) as err:
        execute(e, StepPlan(checkpoint=("a",)))
    assert err.value.reason is RefusalReason.ONLINE_EVICTION
    execute(e, StepPlan(release=("b",)))
    snap = {s.req_id: s for s in e.snapshot()}["b"]
    assert snap.is_released and snap.status == "swapped" and snap.num_blocks == 0
    assert snap.num_checkpointed_tokens == snap.num_computed_tokens == 2 * BS
    assert e.num_checkpoint_lost_tokens == 5
    e.check_integrity()
    execute(e, StepPlan(swap_in=("b",)))
    assert e.num_restored_tokens == 2 * BS and e.seqs["b"].num_pending == 6
    run_to_end(e)
    assert e.num_checkpoint_bytes == 0
