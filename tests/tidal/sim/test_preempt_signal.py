"""The scheduler's preempt signal in the simulator (`preempt_for_online`,
`tidal/sim/preempt_signal.py`): the live scenario of `tests/services/scheduler/test_preempt.py`
on the simulator, with the same outcome: the online request that would end for lack of KV on
the instance its policy picks runs at once where the offline work was preempted for it; with
request classes, where a lower class's work was."""

from __future__ import annotations

import pytest

from tests.tidal.sim.test_core import OFF, SLO, make_policy_for, make_setup, req
from tidal.config.classes import parse_classes
from tidal.policy.state import InstanceRole, Phase
from tidal.schemas.enums import RequestClass
from tidal.sim.classes import ClassGate
from tidal.sim.core import Simulator
from tidal.workload.mix import SimRequest

AGG2 = (InstanceRole.AGGREGATED, InstanceRole.AGGREGATED)


@pytest.mark.parametrize("signals", [True, False])
def test_an_online_request_gets_room_by_a_preempt_signal(signals: bool) -> None:
    # 10 KV blocks of 16 per instance; step = 0.01 + 0.001 * tokens.
    sim = Simulator(
        [make_setup(num_blocks=10), make_setup(num_blocks=10)],
        make_policy_for("aggregated", AGG2),
        check=True,
        preempt_for_online=signals,
    )
    rec = sim.run(
        [
            req("hog", 0.0, 60, 100),  # online, on instance 0 (the tie's first)
            req("off", 0.0, 60, 100, OFF),  # instance 1 (0 has the hog's prompt queued)
            # 0.07 s prefills, then 0.011 s decodes: at 0.7 s each holds ~117 tokens (8 blocks)
            # and 2 blocks are free; "on" needs 4 (60 tokens and its first)
            req("on", 0.7, 60, 10),
        ]
    )
    by_id = {r.req_id: r for r in rec.requests}
    hog, off, on = by_id["hog"], by_id["off"], by_id["on"]
    assert hog.num_output_tokens == 100 and off.num_output_tokens == 100  # offline completes
    assert hog.finish_s is not None
    if signals:
        assert rec.num_preempt_signals == 1 and rec.num_preempt_signal_victims == 1
        assert on.instance_id == 1 and on.num_output_tokens == 10
        assert on.start_s is not None and on.start_s < 0.72  # at the next step boundary
        assert on.first_token_s is not None and on.first_token_s < hog.finish_s
        assert off.num_preemptions >= 1  # by the signal (recompute: no checkpoints here)
    else:
        assert rec.num_preempt_signals == 0
        assert on.instance_id == 0  # the policy's pick, its KV held by online work
        assert on.phase is Phase.REJECTED and dict(rec.rejections) == {"out_of_kv": 1}


def test_with_checkpoints_the_signal_releases_and_loses_under_two_blocks() -> None:
    setups = [make_setup(num_blocks=10, ckpt_capacity_tokens=10_000) for _ in AGG2]
    sim = Simulator(
        setups,
        make_policy_for("aggregated", AGG2, checkpoint_offline=True),
        check=True,
        preempt_for_online=True,
    )
    rec = sim.run([req("hog", 0.0, 60, 100), req("off", 0.0, 60, 100, OFF), req("on", 0.7, 60, 10)])
    by_id = {r.req_id: r for r in rec.requests}
    assert rec.num_preempt_signals == 1 and rec.num_releases >= 1  # released, not recomputed
    assert 0 < rec.num_checkpoint_lost_tokens < 2 * 16 * rec.num_releases
    assert by_id["on"].instance_id == 1 and by_id["on"].num_output_tokens == 10
    assert by_id["off"].num_output_tokens == 100


def test_a_higher_class_gets_room_from_a_lower_class_never_its_own() -> None:
    """The live scenario of the scheduler's class test: standard work fills instance 0, an
    interactive request instance 1; a second interactive request goes where the signal (with
    `below_priority` = its priority) preempts the standard one, not its own class."""
    table = parse_classes(
        [
            {"name": "interactive", "priority": 2, "ttft_ms": 1000},
            {"name": "standard", "priority": 1, "ttft_ms": 1000},
            {"name": "batch", "priority": 0, "best_effort": True},
        ]
    )
    sim = Simulator(
        [make_setup(num_blocks=10), make_setup(num_blocks=10)],
        make_policy_for("aggregated", AGG2),
        check=True,
        preempt_for_online=True,
        classes=ClassGate(table, SLO),
    )

    def asks(rid: str, t: float, out: int, cls: str) -> SimRequest:
        return SimRequest(rid, RequestClass.ONLINE, t, 60, out, class_name=cls)

    rec = sim.run(
        [
            asks("std", 0.0, 100, "standard"),  # instance 0 (the tie's first)
            asks("top", 0.0, 100, "interactive"),  # instance 1
            asks("on", 0.7, 10, "interactive"),  # 2 blocks free on each, 4 needed
        ]
    )
    by_id = {r.req_id: r for r in rec.requests}
    std, top, on = by_id["std"], by_id["top"], by_id["on"]
    assert rec.num_preempt_signals == 1 and rec.num_preempt_signal_victims == 1
    assert on.instance_id == 0 and on.num_output_tokens == 10
    assert on.first_token_s is not None and std.finish_s is not None
    assert on.first_token_s < std.finish_s  # it did not wait for the standard request
    assert std.num_preemptions >= 1 and top.num_preemptions == 0
    assert all(r.phase is Phase.FINISHED for r in (std, top, on))
