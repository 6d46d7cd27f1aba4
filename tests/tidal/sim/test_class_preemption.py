"""A higher class evicts a lower one in the simulator: three classes on one instance with a
small KV pool; an interactive request that finds the pool full of standard work evicts the
latest standard request (recomputed later, as often as the interactive one needs its room) and
keeps its TTFT target; with the priorities the other way round the standard requests evict the
interactive one when they run short, and it misses its target."""

from __future__ import annotations

import pytest

from tidal.config.classes import ClassTable, parse_classes
from tidal.perf.linear import LinearStepModel
from tidal.policy import InstanceRole, PolicyContext, Slo, make_policy
from tidal.policy.state import Phase, ReqState
from tidal.schemas.enums import RequestClass
from tidal.sim.classes import ClassGate, ClassRow, class_rows
from tidal.sim.core import InstanceSetup, Simulator
from tidal.sim.metrics import slo_flags
from tidal.sim.recorder import Recorder
from tidal.workload.mix import SimRequest

SLO = Slo(1.0, 0.1)


def table(interactive: int, standard: int) -> ClassTable:
    return parse_classes(
        [
            {"name": "interactive", "priority": interactive, "ttft_ms": 400, "tpot_ms": 100},
            {"name": "standard", "priority": standard, "ttft_ms": 4000, "tpot_ms": 200},
            {"name": "batch", "priority": 0, "best_effort": True},
        ]
    )


def workload() -> list[SimRequest]:
    """Three standard requests fill most of the 40-block pool (13 blocks each at their end);
    at 0.6 s they hold about 30 and an interactive prompt needing 13 arrives; a batch line
    too."""
    std = [SimRequest(f"s{k}", RequestClass.ONLINE, 0.01 * k, 150, 50, class_name="standard")
           for k in range(3)]  # fmt: skip
    return [
        SimRequest("b0", RequestClass.OFFLINE, 0.0, 20, 5, class_name="batch"),
        *std,
        SimRequest("i0", RequestClass.ONLINE, 0.6, 200, 20, class_name="interactive"),
    ]


def run(
    interactive: int, standard: int, policy: str
) -> tuple[Recorder, dict[str, ReqState], dict[str, ClassRow]]:
    model = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0,
                            per_attn_pair_s=0.0)  # fmt: skip
    setup = InstanceSetup(InstanceRole.AGGREGATED, 512, 40, model, 1000.0)
    gate = ClassGate(table(interactive, standard), SLO)
    ctx = PolicyContext(1, (InstanceRole.AGGREGATED,), SLO, {})
    sim = Simulator([setup], make_policy(policy, ctx), classes=gate, check=True)
    rec = sim.run(workload())
    return (
        rec,
        {r.req_id: r for r in rec.requests},
        {row.name: row for row in class_rows(gate, rec.requests)},
    )


@pytest.mark.parametrize("policy", ["aggregated", "omniserve", "taichi", "hygen"])
def test_the_top_class_evicts_the_middle_one_and_keeps_its_slo(policy: str) -> None:
    rec, by, rows = run(2, 1, policy)
    assert all(r.phase is Phase.FINISHED for r in by.values())  # the evicted one too
    assert all(slo_flags(by["i0"]))  # TTFT within 400 ms, TPOT within 100 ms
    assert rows["interactive"].num_preemptions == 0
    assert rows["standard"].num_preemptions >= 1
    assert by["s2"].num_preemptions >= 1  # the latest standard arrival goes first
    assert rec.num_class_evictions >= 1
    assert rows["interactive"].attainment == 1.0


def test_the_other_way_round_the_interactive_request_is_the_one_evicted() -> None:
    rec, by, rows = run(1, 2, "aggregated")  # standard now outranks interactive
    assert rows["standard"].num_preemptions == 0  # never evicted by a lower class
    assert rows["interactive"].num_preemptions == rec.num_class_evictions >= 1
    assert not all(slo_flags(by["i0"]))  # it waited for memory: past 400 ms to its first token
    assert all(r.phase is Phase.FINISHED for r in by.values())
