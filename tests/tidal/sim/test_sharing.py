"""Instances sharing devices (`num_devices`): their steps run under processor sharing, each at
1/k of its speed while k step on one device; a step's end moves whenever another starts or ends;
layer cuts land on the shared times; the measured step-time scale follows; unshared runs are
unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.config.cluster import load_config
from tidal.perf.linear import LinearStepModel
from tidal.policy.base import Policy, Route, StepPlan
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, ReqState
from tidal.schemas.enums import RequestClass
from tidal.sim.build import simulate, with_offline_rate
from tidal.sim.core import InstanceSetup, Simulator
from tidal.sim.sharing import DeviceShare
from tidal.workload.mix import SimRequest

# a step takes 0.01 s + 1 ms a token, alone on a device
LINEAR = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0, per_attn_pair_s=0.0)
ON, OFF = RequestClass.ONLINE, RequestClass.OFFLINE


class Pinned(Policy):
    """Request "<i>..." to instance i; online prompts first, whole, then decodes (repeated up
    to `repeat` steps); offline steps preemptible at a layer when `layer_cut`."""

    def __init__(self, repeat: int = 1, layer_cut: bool = False) -> None:
        self.repeat = repeat
        self.layer_cut = layer_cut
        self.scales: list[tuple[int, float]] = []  # (instance, step_time_scale) at each step

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        return Route.to(int(req.req_id[0]))

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        if inst.waiting or inst.running:
            self.scales.append((inst.instance_id, inst.step_time_scale))
        todo = sorted(
            [r for r in inst.running if r.num_prefill_left > 0] + inst.waiting,
            key=lambda r: not r.is_online,
        )
        if todo:
            r = todo[0]
            return StepPlan(prefill={r.req_id: r.num_prefill_left}, layer_cut=self.layer_cut)
        dec = tuple(r.req_id for r in inst.running if r.is_decoding)
        return StepPlan(decode=dec, max_repeat=self.repeat) if dec else StepPlan()


def _sim(
    policy: Policy, num_devices: int | None, n: int = 2, layers: int = 32, slowdown: float = 1.0
) -> Simulator:
    setup = InstanceSetup(InstanceRole.AGGREGATED, 4096, 200, LINEAR, 1.0, num_layers=layers)
    return Simulator(
        [setup] * n, policy, check=True, num_devices=num_devices, shared_device_slowdown=slowdown
    )


def _run(sim: Simulator, *reqs: SimRequest) -> dict[str, ReqState]:
    return {r.req_id: r for r in sim.run(list(reqs)).requests}


def test_two_instances_on_one_device_each_take_twice_as_long_while_both_step() -> None:
    both = (SimRequest("0a", ON, 0.0, 90, 1), SimRequest("1b", ON, 0.0, 90, 1))
    own = _run(_sim(Pinned(), None), *both)
    assert own["0a"].first_token_s == own["1b"].first_token_s == pytest.approx(0.1)
    sim = _sim(Pinned(), 1)
    shared = _run(sim, *both)
    assert shared["0a"].first_token_s == shared["1b"].first_token_s == pytest.approx(0.2)
    # each measured its step at twice its time alone, as the live instance would
    assert [i.step_time_scale for i in sim.instances] == [pytest.approx(2.0)] * 2
    # as many devices as instances: each has its own, nothing shared
    every = {k: dataclasses.asdict(r) for k, r in _run(_sim(Pinned(), 2), *both).items()}
    assert every == {k: dataclasses.asdict(r) for k, r in own.items()}


def test_a_step_alone_on_the_shared_device_runs_at_full_speed() -> None:
    sim = _sim(Pinned(), 1)
    alone = _run(sim, SimRequest("0a", ON, 0.0, 90, 1))
    assert alone["0a"].first_token_s == pytest.approx(0.1)
    assert [i.step_time_scale for i in sim.instances] == [1.0, 1.0]
    assert sim.sharing is not None and sim.sharing.slowdown(1) == 1.0


def test_a_step_starting_midway_moves_the_others_end() -> None:
    # a alone for 0.05 s (half its work), then both at half speed: a's other half takes 0.1 s,
    # to 0.15; b did half its work by then and runs its other half alone, to 0.2
    got = _run(
        _sim(Pinned(), 1), SimRequest("0a", ON, 0.0, 90, 1), SimRequest("1b", ON, 0.05, 90, 1)
    )
    assert got["0a"].first_token_s == pytest.approx(0.15)
    assert got["1b"].first_token_s == pytest.approx(0.2)


def test_a_run_of_decode_steps_is_rescaled_step_by_step() -> None:
    # a: prefill alone to 0.1, then 10 decode steps of 0.011 s as one span. b lands on the
    # other instance half-way through a's first decode (0.1055) with a 0.1 s prefill: from
    # then both run at half speed (a's steps 0.022 s) until b ends at 0.1055 + 0.2 = 0.3055;
    # a has 0.0045 s of work left then, alone: it ends at 0.31.
    policy = Pinned(repeat=16)
    sim = _sim(policy, 1)
    got = _run(sim, SimRequest("0a", ON, 0.0, 90, 11), SimRequest("1b", ON, 0.1055, 90, 1))
    a, b = got["0a"], got["1b"]
    assert a.first_token_s == pytest.approx(0.1)
    assert b.first_token_s == pytest.approx(0.3055)
    assert a.finish_s == pytest.approx(0.31)
    assert a.max_tbt_s == pytest.approx(0.022)  # a whole decode step at half speed
    # Σ measured / Σ alone over a's steps: 0.1 s prefill alone, decodes 0.11 s of work in 0.21
    assert sim.instances[0].step_time_scale == pytest.approx((0.1 + 0.21) / (0.1 + 0.11))
    assert sim.instances[1].step_time_scale == pytest.approx(2.0)


def test_the_policy_plans_with_the_measured_scale() -> None:
    policy = Pinned()
    reqs = [SimRequest("0a", ON, 0.0, 90, 1), SimRequest("1b", ON, 0.0, 90, 1)]
    reqs += [SimRequest("0c", ON, 0.5, 90, 1)]
    _run(_sim(policy, 1), *reqs)
    assert (0, 1.0) in policy.scales  # the first plan: nothing measured yet
    assert policy.scales[-1] == (0, pytest.approx(2.0))  # c's plan: a ran at half speed


def test_a_layer_cut_lands_on_the_shared_layer_boundaries() -> None:
    # off on instance 0: 0.01 s fixed, then 10 layers of 0.099 s alone. Instance 1's 0.1 s
    # step shares the device until 0.2. "on" reaches instance 0 at 0.15, in off's first layer,
    # which ends at work 0.109: 0.2 s of shared time did 0.1, the last 0.009 alone -> 0.209.
    # on's prefill runs alone to 0.309; off resumes at layer 1: 0.01 + 9 x 0.099 -> 1.21.
    sim = _sim(Pinned(layer_cut=True), 1, layers=10)
    got = _run(
        sim,
        SimRequest("0off", OFF, 0.0, 990, 1),
        SimRequest("1b", ON, 0.0, 90, 1),
        SimRequest("0on", ON, 0.15, 90, 1),
    )
    assert got["1b"].first_token_s == pytest.approx(0.2)
    assert got["0on"].first_token_s == pytest.approx(0.309)
    assert got["0off"].first_token_s == pytest.approx(1.21)
    assert sim.rec.num_layer_preemptions == 1 and not sim.cuts


def test_three_instances_on_two_devices_each_run_at_two_thirds_speed() -> None:
    reqs = [SimRequest(f"{i}x", ON, 0.0, 90, 1) for i in range(3)]
    got = _run(_sim(Pinned(), 2, n=3), *reqs)
    assert [r.first_token_s for r in got.values()] == [pytest.approx(0.15)] * 3


def test_the_contention_factor_slows_steps_only_while_they_share() -> None:
    # c = 1.1: while both step each runs at (1 / 2) / 1.1 of its speed; alone, at its own
    sim = _sim(Pinned(), 1, slowdown=1.1)
    both = _run(sim, SimRequest("0a", ON, 0.0, 90, 1), SimRequest("1b", ON, 0.0, 90, 1))
    assert both["0a"].first_token_s == both["1b"].first_token_s == pytest.approx(0.22)
    assert [i.step_time_scale for i in sim.instances] == [pytest.approx(2.2)] * 2
    assert sim.sharing is not None
    assert [sim.sharing.slowdown(k) for k in (0, 1, 2)] == [1.0, 1.0, pytest.approx(2.2)]
    alone_sim = _sim(Pinned(), 1, slowdown=1.1)
    alone = _run(alone_sim, SimRequest("0a", ON, 0.0, 90, 1))
    assert alone["0a"].first_token_s == pytest.approx(0.1)
    assert [i.step_time_scale for i in alone_sim.instances] == [1.0, 1.0]
    # a joins midway: a alone 0.05 s (half its work), then both at 1 / 2.2: a's other half takes
    # 0.11 s, to 0.16; b did 0.05 of work by then and runs its other half alone, to 0.21
    got = _run(
        _sim(Pinned(), 1, slowdown=1.1),
        SimRequest("0a", ON, 0.0, 90, 1),
        SimRequest("1b", ON, 0.05, 90, 1),
    )
    assert got["0a"].first_token_s == pytest.approx(0.16)
    assert got["1b"].first_token_s == pytest.approx(0.21)
    # three on two devices: each at (2 / 3) / 1.1
    three = _run(
        _sim(Pinned(), 2, n=3, slowdown=1.1),
        *(SimRequest(f"{i}x", ON, 0.0, 90, 1) for i in range(3)),
    )
    assert [r.first_token_s for r in three.values()] == [pytest.approx(0.165)] * 3


def test_the_contention_factor_leaves_unshared_runs_and_its_default_unchanged() -> None:
    both = (SimRequest("0a", ON, 0.0, 90, 1), SimRequest("1b", ON, 0.0, 90, 1))

    def rows(sim: Simulator) -> dict[str, dict]:
        return {k: dataclasses.asdict(r) for k, r in _run(sim, *both).items()}

    own = rows(_sim(Pinned(), None))
    assert rows(_sim(Pinned(), None, slowdown=1.5)) == own  # each on its own device: no sharing
    assert rows(_sim(Pinned(), 2, slowdown=1.5)) == own
    shared = rows(_sim(Pinned(), 1))
    assert rows(_sim(Pinned(), 1, slowdown=1.0)) == shared  # the default is c = 1
    cfg = load_config("configs/ooco.yaml")
    assert cfg.shared_device_slowdown == 1.0
    with pytest.raises(ValueError, match="shared_device_slowdown"):
        dataclasses.replace(cfg, shared_device_slowdown=0.9)
    with pytest.raises(ValueError, match="shared_device_slowdown"):
        DeviceShare(1, 2, lambda t, p: None, slowdown=0.5)


def test_bad_device_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="num_devices"):
        _sim(Pinned(), 0)
    with pytest.raises(ValueError, match="num_devices"):
        DeviceShare(2, 2, lambda t, p: None)
    cfg = load_config("configs/ooco.yaml")
    with pytest.raises(ValueError, match="num_devices"):
        dataclasses.replace(cfg, num_devices=0)


def test_a_config_without_sharing_runs_as_before_and_one_device_slows_it() -> None:
    cfg = with_offline_rate(
        dataclasses.replace(load_config("configs/ooco.yaml"), duration_s=10.0, drain_s=5.0), 8.0
    )
    n = sum(g.count for g in cfg.groups_for("tidal"))
    assert n == 2

    def run(c: object) -> tuple[list[tuple], float]:
        rec = simulate(c, "tidal")  # type: ignore[arg-type]
        reqs = [(r.req_id, r.phase, r.first_token_s, r.finish_s) for r in rec.requests]
        return reqs, sum(rec.offline_tokens)

    base, tokens = run(cfg)
    assert run(dataclasses.replace(cfg, num_devices=n)) == (base, tokens)  # one each: no sharing
    unshared = dataclasses.replace(cfg, shared_device_slowdown=1.2)
    assert run(unshared) == (base, tokens)  # the contention factor needs shared devices
    one, one_tokens = run(dataclasses.replace(cfg, num_devices=1))
    assert one != base
    # alone, the two instances step 24 of their 30 instance-seconds: one device's 15 s make
    # fewer tokens (not in proportion: its slower steps batch more)
    assert one_tokens < 0.9 * tokens
    # and each shared step doing 20 % more work makes fewer still
    _, slower_tokens = run(dataclasses.replace(cfg, num_devices=1, shared_device_slowdown=1.2))
    assert slower_tokens < one_tokens
