"""Request classes in the simulator: queue bounds, demotion down the chain, rejection when no
class takes a request, the per-class table, and the held queue's priority order."""

from __future__ import annotations

from tidal.config.classes import parse_classes
from tidal.perf.linear import LinearStepModel
from tidal.policy import InstanceRole, PolicyContext, Slo, make_policy
from tidal.policy.base import Policy, Route
from tidal.policy.baselines.aggregated import AggregatedConfig, AggregatedPolicy
from tidal.policy.state import ClusterView, Phase, ReqState
from tidal.schemas.enums import RequestClass
from tidal.sim.classes import ClassGate, class_rows, hold
from tidal.sim.core import InstanceSetup, Simulator
from tidal.workload.mix import SimRequest

SLO = Slo(1.0, 0.1)
AGG = (InstanceRole.AGGREGATED,)
TABLE = parse_classes(
    [
        {"name": "interactive", "priority": 2, "ttft_ms": 100, "tpot_ms": 50, "queue_bound": 1,
         "demote": True},
        {"name": "standard", "priority": 1, "ttft_ms": 4000, "queue_bound": 1, "demote": True},
        {"name": "batch", "priority": 0, "best_effort": True},
    ]
)  # fmt: skip


def setup() -> InstanceSetup:
    # step = 0.01 s + 1 ms per token
    model = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0,
                            per_attn_pair_s=0.0)  # fmt: skip
    return InstanceSetup(InstanceRole.AGGREGATED, 512, 100, model, 1000.0)


def run(policy: Policy, reqs: list[SimRequest]) -> tuple[ClassGate, list[ReqState]]:
    gate = ClassGate(TABLE, SLO)
    rec = Simulator([setup()], policy, classes=gate, check=True).run(reqs)
    return gate, rec.requests


def asks(name: str, rid: str, t: float = 0.0) -> SimRequest:
    return SimRequest(rid, RequestClass.ONLINE, t, 50, 4, None, class_name=name)


def test_a_full_class_demotes_down_its_chain_and_the_last_rejects() -> None:
    policy = make_policy("aggregated", PolicyContext(1, AGG, SLO, {}))
    # three interactive at once, bounds of 1: the first runs interactive, the second standard,
    # the third batch (best effort, no bound)
    gate, reqs = run(policy, [asks("interactive", f"i{k}") for k in range(3)])
    by = {r.req_id: r for r in reqs}
    assert [by[f"i{k}"].class_name for k in range(3)] == ["interactive", "standard", "batch"]
    assert by["i2"].req_class is RequestClass.OFFLINE and by["i2"].slo is None
    assert by["i1"].slo == Slo(4.0, 0.1)  # standard's TTFT, the default TPOT
    assert by["i1"].priority == 1
    assert all(r.phase is Phase.FINISHED for r in reqs)
    rows = {row.name: row for row in class_rows(gate, reqs)}
    assert (rows["interactive"].num_asked, rows["interactive"].num_demoted) == (3, 2)
    assert rows["interactive"].num_rejected == 0
    assert (rows["standard"].num_served, rows["batch"].num_served) == (1, 1)
    assert rows["batch"].attainment is None  # no SLO


def test_rejected_only_when_no_class_of_the_chain_takes_it() -> None:
    table = parse_classes(
        [
            {"name": "interactive", "priority": 2, "ttft_ms": 100, "queue_bound": 1},
            {"name": "batch", "priority": 0, "best_effort": True},
        ]
    )
    gate = ClassGate(table, SLO)
    policy = make_policy("aggregated", PolicyContext(1, AGG, SLO, {}))
    rec = Simulator([setup()], policy, classes=gate).run(
        [asks("interactive", "a"), asks("interactive", "b"), asks("batch", "c")]
    )
    by = {r.req_id: r for r in rec.requests}
    assert by["b"].phase is Phase.REJECTED and by["b"].class_name == "interactive"
    assert by["a"].phase is Phase.FINISHED and by["c"].phase is Phase.FINISHED
    rows = {row.name: row for row in class_rows(gate, rec.requests)}
    assert (rows["interactive"].num_rejected, rows["interactive"].num_demoted) == (1, 0)
    assert rows["interactive"].attainment == 1.0  # a: 60 ms to its first token, within 100


class RefusesTightSlo(AggregatedPolicy):
    """Admission control stand-in: online requests with a TTFT target under 1 s are refused."""

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        if req.slo is not None and req.slo.ttft_s < 1.0:
            return Route.reject("would miss its TTFT SLO")
        return super().route(req, cluster, now)


def test_a_policy_refusal_demotes_to_the_class_it_admits() -> None:
    policy = RefusesTightSlo(AggregatedConfig())
    gate, reqs = run(policy, [asks("interactive", "a", 0.0), asks("interactive", "b", 5.0)])
    assert [r.class_name for r in reqs] == ["standard", "standard"]  # bound freed by then
    assert all(r.phase is Phase.FINISHED and r.slo == Slo(4.0, 0.1) for r in reqs)
    rows = {row.name: row for row in class_rows(gate, reqs)}
    assert rows["interactive"].num_demoted == 2
    assert rows["standard"].attainment == 1.0


def test_held_queue_orders_by_priority_fifo_within() -> None:
    held: list[ReqState] = []
    for rid, prio in (("a", 0), ("b", 0), ("c", 1), ("d", 0), ("e", 1)):
        r = ReqState(rid, RequestClass.OFFLINE, 0.0, 10, 10)
        r.priority = prio
        hold(held, r)
    assert [r.req_id for r in held] == ["c", "e", "a", "b", "d"]


def test_admission_queue_is_never_refused_for_its_slo_admission_slo_is() -> None:
    table = parse_classes(
        [
            {"name": "instant", "priority": 3, "ttft_ms": 1},  # 1 ms: no prefill meets it
            {"name": "patient", "priority": 2, "ttft_ms": 1, "admission": "queue"},
            {"name": "batch", "priority": 0, "best_effort": True},
        ]
    )
    for name in ("omniserve", "tidal"):
        roles = AGG if name == "omniserve" else (InstanceRole.RELAXED, InstanceRole.STRICT)
        gate = ClassGate(table, SLO)
        policy = make_policy(name, PolicyContext(len(roles), roles, SLO, {}))
        rec = Simulator([setup() for _ in roles], policy, classes=gate, check=True).run(
            [asks("instant", "a"), asks("patient", "b")]
        )
        by = {r.req_id: r for r in rec.requests}
        assert by["a"].phase is Phase.REJECTED, name  # the policy's SLO admission refused it
        assert by["b"].phase is Phase.FINISHED and not by["b"].slo_admission, name
        rows = {row.name: row for row in class_rows(gate, rec.requests)}
        assert rows["patient"].attainment == 0.0  # served, late: it waited instead
