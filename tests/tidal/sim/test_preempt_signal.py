"""The scheduler's preempt signal in the simulator (`preempt_for_online`,
`tidal/sim/preempt_signal.py`): the live scenario of `tests/services/scheduler/test_preempt.py`
on the simulator, with the same outcome: the online request that would end for lack of KV on
the instance its policy picks runs at once where the offline work was preempted for it."""

from __future__ import annotations

import pytest

from tests.tidal.sim.test_core import OFF, make_policy_for, make_setup, req
from tidal.policy.state import InstanceRole, Phase
from tidal.sim.core import Simulator

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
