"""The simulator core on tiny hand-checkable scenarios, its invariants and its determinism."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy import InstanceRole, PolicyContext, Slo, make_policy
from tidal.policy.base import Policy, StepPlan
from tidal.policy.state import InstanceState, Phase
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.workload.mix import SimRequest

SLO = Slo(1.0, 0.1)
ON, OFF = RequestClass.ONLINE, RequestClass.OFFLINE


def make_setup(role: InstanceRole = InstanceRole.AGGREGATED, **kw: object) -> InstanceSetup:
    args: dict[str, object] = dict(
        role=role,
        chunk_size=512,
        num_blocks=100,
        step_model=LinearStepModel(
            base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0, per_attn_pair_s=0.0
        ),
        kv_bytes_per_token=1000.0,
        block_size=16,
    )
    args.update(kw)
    return InstanceSetup(**args)  # type: ignore[arg-type]


def make_policy_for(name: str, roles: tuple[InstanceRole, ...], **params: object) -> Policy:
    return make_policy(name, PolicyContext(len(roles), roles, SLO, params))


def req(rid: str, t: float, inp: int, out: int, cls: RequestClass = ON) -> SimRequest:
    return SimRequest(rid, cls, t, inp, out, SLO if cls is ON else None)


def test_two_requests_exact_ttft_and_tpot() -> None:
    # step = 0.01 + 0.001 * tokens.
    # t=0: a arrives, prefill a (100 tok) -> 0.11: a's first token.
    # b (same instant, next event) waits; 0.11: decode a + prefill b (1+200) -> 0.321: b first.
    # 0.321: decode a,b (2 tok) 0.012 -> 0.333; -> 0.345 (b has 3 tokens: done);
    # 0.345: decode a (1 tok) 0.011 -> 0.356 (a has 5 tokens: done).
    sim = Simulator([make_setup()], make_policy_for("aggregated", (InstanceRole.AGGREGATED,)))
    rec = sim.run([req("a", 0.0, 100, 5), req("b", 0.0, 200, 3)])
    a, b = (next(r for r in rec.requests if r.req_id == x) for x in "ab")
    assert a.first_token_s == pytest.approx(0.11)
    assert b.first_token_s == pytest.approx(0.321)
    assert b.finish_s == pytest.approx(0.345)
    assert a.finish_s == pytest.approx(0.356)
    assert (a.finish_s - a.first_token_s) / 4 == pytest.approx((0.356 - 0.11) / 4)
    assert (b.finish_s - b.first_token_s) / 2 == pytest.approx(0.012)
    assert rec.num_steps == 5
    # b's gaps: 0.321 -> 0.333 -> 0.345; a's longest is the 0.211 s prefill step of b.
    assert b.max_tbt_s == pytest.approx(0.012)
    assert a.max_tbt_s == pytest.approx(0.211)


class NoRepeat(Policy):
    """Wraps a policy and forbids multi-step spans: the reference for the speed hint."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def route(self, req, cluster, now):  # type: ignore[no-untyped-def]
        return self.inner.route(req, cluster, now)

    def place_decode(self, req, inst, cluster, now):  # type: ignore[no-untyped-def]
        return self.inner.place_decode(req, inst, cluster, now)

    def tick(self, cluster, now):  # type: ignore[no-untyped-def]
        return self.inner.tick(cluster, now)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        return dataclasses.replace(self.inner.schedule(inst, now), max_repeat=1)


def _mixed_workload(n: int = 60) -> list[SimRequest]:
    out = []
    for i in range(n):
        cls = ON if i % 3 else OFF
        out.append(req(f"r{i}", i * 0.05, 50 + 37 * (i % 7), 5 + 11 * (i % 5), cls))
    return out


@pytest.mark.parametrize("policy", ["aggregated", "base-pd", "online-priority"])
def test_spans_match_step_by_step(policy: str) -> None:
    roles = (InstanceRole.PREFILL, InstanceRole.DECODE)
    if policy == "aggregated":
        roles = (InstanceRole.AGGREGATED, InstanceRole.AGGREGATED)
    setups = [make_setup(r) for r in roles]
    fast = Simulator(setups, make_policy_for(policy, roles), check=True).run(_mixed_workload())
    slow = Simulator(setups, NoRepeat(make_policy_for(policy, roles)), check=True).run(
        _mixed_workload()
    )
    assert fast.num_spans < slow.num_spans  # the hint did something
    for a, b in zip(fast.requests, slow.requests, strict=True):
        assert a.req_id == b.req_id
        assert a.first_token_s == pytest.approx(b.first_token_s)
        assert a.finish_s == pytest.approx(b.finish_s)


@pytest.mark.parametrize("policy", ["aggregated", "pd-disagg", "online-priority"])
def test_invariants_under_memory_pressure(policy: str) -> None:
    # 40 blocks of 16 tokens: far less than the workload wants, so preemption, swapping and
    # hand-off waits all happen; check_integrity runs after every event.
    roles = (InstanceRole.AGGREGATED,) * 2
    if policy != "aggregated":
        roles = (InstanceRole.PREFILL, InstanceRole.DECODE)
    setups = [make_setup(r, num_blocks=40) for r in roles]
    reqs = _mixed_workload(80)
    rec = Simulator(setups, make_policy_for(policy, roles), check=True).run(reqs)
    ids = [r.req_id for r in rec.requests]
    assert sorted(ids) == sorted(r.req_id for r in reqs)  # none lost, none duplicated
    assert all(r.finish_s is not None for r in rec.requests)
    by_id = {r.req_id: r for r in rec.requests}
    # The plan contract: online work is never evicted; an online request that cannot get KV
    # while no offline work is left to evict ends, counted as rejected for "out_of_kv".
    ended = [r for r in rec.requests if r.phase is Phase.REJECTED]
    assert all(r.is_online for r in ended)
    assert len(ended) == rec.rejections["out_of_kv"]
    assert all(r.num_preemptions == 0 for r in rec.requests if r.is_online)
    for sr in reqs:
        r = by_id[sr.req_id]
        if r.phase is not Phase.REJECTED:
            assert r.num_output_tokens == sr.output_tokens
            assert r.arrival_s <= (r.first_token_s or 0) <= (r.finish_s or 0)
    if policy != "pd-disagg":  # its online work now waits for hand-off room, never evicted
        assert rec.num_preemptions + rec.num_swaps + rec.rejections["out_of_kv"] > 0


def test_same_seed_same_result() -> None:
    roles = (InstanceRole.PREFILL, InstanceRole.DECODE)

    def run() -> list[tuple[str, float | None, float | None]]:
        sim = Simulator([make_setup(r) for r in roles], make_policy_for("base-pd", roles))
        return [
            (r.req_id, r.first_token_s, r.finish_s) for r in sim.run(_mixed_workload()).requests
        ]

    assert run() == run()


def test_pd_transfer_time_counts() -> None:
    # Prefill 100 tokens on P (0.11 s), first token at 0.11, then 100 tokens of KV at
    # 1000 B/token over 1e6 B/s = 0.1 s; decode on D from 0.21: 0.01 + 0.001 = 0.011 per step.
    roles = (InstanceRole.PREFILL, InstanceRole.DECODE)
    sim = Simulator(
        [make_setup(r) for r in roles], make_policy_for("pd-disagg", roles), link_bytes_per_s=1e6
    )
    rec = sim.run([req("a", 0.0, 100, 3)])
    (a,) = rec.requests
    assert a.first_token_s == pytest.approx(0.11)
    assert a.finish_s == pytest.approx(0.21 + 2 * 0.011)
    assert a.instance_id == 1
    assert rec.num_kv_transfers == 1


def test_horizon_stops_the_run() -> None:
    sim = Simulator(
        [make_setup()], make_policy_for("aggregated", (InstanceRole.AGGREGATED,)), horizon_s=0.2
    )
    rec = sim.run([req("a", 0.0, 100, 1000)])
    assert rec.end_s <= 0.2
    assert rec.requests[0].finish_s is None
