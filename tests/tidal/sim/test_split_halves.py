"""A policy's two halves share nothing but messages: running the cluster half (`route`,
`place_decode`, `tick`) and the instance half (`schedule`) on two policy objects built from the
same config makes exactly the decisions one object makes (DESIGN.md, "The live loop")."""

from __future__ import annotations

import random

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy import InstanceRole, PolicyContext, Slo, make_policy
from tidal.policy.base import ClusterActions, Policy, Route, StepPlan
from tidal.policy.registry import available_policies
from tidal.policy.state import ClusterView, CpuPoolState, InstanceState, ReqState
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.sim.models import CpuAttnRoofline
from tidal.sim.recorder import Recorder
from tidal.workload.mix import SimRequest

SLO = Slo(1.0, 0.05)
MODEL = LinearStepModel(base_s=0.008, per_token_s=6e-5, per_ctx_token_s=3e-8, per_attn_pair_s=2e-10)
R = InstanceRole
ROLES: dict[str, tuple[InstanceRole, ...]] = {
    "pd-disagg": (R.PREFILL, R.PREFILL, R.DECODE, R.DECODE),
    "base-pd": (R.PREFILL, R.PREFILL, R.DECODE, R.DECODE),
    "online-priority": (R.PREFILL, R.PREFILL, R.DECODE, R.DECODE),
    "ooco": (R.RELAXED, R.RELAXED, R.STRICT, R.STRICT),
    "tidal": (R.RELAXED, R.RELAXED, R.STRICT, R.STRICT),
}


class Split(Policy):
    """The cluster half from one object, the instance half from another."""

    def __init__(self, cluster_half: Policy, instance_half: Policy) -> None:
        self.cluster_half = cluster_half
        self.instance_half = instance_half

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        return self.cluster_half.route(req, cluster, now)

    def place_decode(
        self, req: ReqState, inst: InstanceState, cluster: ClusterView, now: float
    ) -> int | None:
        return self.cluster_half.place_decode(req, inst, cluster, now)

    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        return self.cluster_half.tick(cluster, now)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        return self.instance_half.schedule(inst, now)


def workload(seed: int = 7) -> list[SimRequest]:
    """20 s of online traffic (8 req/s) beside a backlog of long offline requests."""
    rng = random.Random(seed)
    out: list[SimRequest] = []
    t = 0.0
    while t < 20.0:
        t += rng.expovariate(8.0)
        n_in, n_out = rng.randint(100, 2000), rng.randint(10, 200)
        out.append(SimRequest(f"on{len(out)}", RequestClass.ONLINE, t, n_in, n_out, SLO))
    for k in range(120):
        t_off = rng.uniform(0.0, 10.0)
        n_in, n_out = rng.randint(500, 3000), rng.randint(50, 400)
        out.append(SimRequest(f"off{k}", RequestClass.OFFLINE, t_off, n_in, n_out))
    return sorted(out, key=lambda r: (r.arrival_s, r.req_id))


def run(name: str, split: bool, via_reports: bool = False) -> Recorder:
    roles = ROLES.get(name, (R.AGGREGATED,) * 4)
    ctx = PolicyContext(len(roles), roles, SLO, {}, seed=3)
    policy = make_policy(name, ctx)
    if split:
        policy = Split(policy, make_policy(name, ctx))
    setups = [InstanceSetup(r, 512, 1500, MODEL, 1000.0, max_batch_reqs=64) for r in roles]
    cpu = CpuPoolState(4, CpuAttnRoofline(4000.0), host_kv_capacity_tokens=200_000)
    sim = Simulator(
        setups, policy, link_bytes_per_s=10e9, cpu=cpu, horizon_s=120.0, via_reports=via_reports
    )
    return sim.run(workload())


def outcome(rec: Recorder) -> tuple[object, ...]:
    reqs = sorted(
        (
            r.req_id,
            r.phase.value,
            r.instance_id,
            r.first_token_s,
            r.finish_s,
            r.num_output_tokens,
            r.num_preemptions,
            r.num_migrations,
        )
        for r in rec.requests
    )
    counts = (
        rec.num_steps,
        rec.num_preemptions,
        rec.num_swaps,
        rec.num_offloads,
        rec.num_migrations,
        rec.num_migrations_refused,
        rec.num_kv_transfers,
        sorted(rec.rejections.items()),
    )
    return (tuple(reqs), counts)


@pytest.mark.parametrize("name", available_policies())
def test_two_objects_decide_as_one(name: str) -> None:
    one = run(name, split=False)
    assert sum(r.finish_s is not None for r in one.requests) > 100  # the run did something
    if name in ("ooco", "tidal"):
        assert one.num_migrations > 0  # the pull path (hints from `schedule`) was exercised
    assert outcome(run(name, split=True)) == outcome(one)


@pytest.mark.parametrize("name", available_policies())
def test_cluster_half_on_views_from_reports(name: str) -> None:
    """The cluster half on a view rebuilt from `InstanceReport`s (`tidal.cluster.view`, as the
    live scheduler builds it) decides as on the simulator's own state: reports carry all it
    reads."""
    assert outcome(run(name, split=True, via_reports=True)) == outcome(run(name, split=False))
