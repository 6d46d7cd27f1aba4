"""The Batch API's lines-in-flight cap in the simulator (`Simulator(batch_max_inflight=)`,
`ClusterConfig.batch_max_inflight`): offline requests enter the cluster at most N at a time,
FIFO."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tidal.sim.test_core import OFF, make_policy_for, make_setup, req
from tidal.config.cluster import load_config
from tidal.policy import InstanceRole
from tidal.policy.state import Phase, ReqState
from tidal.sim.build import simulate
from tidal.sim.core import Simulator

AGG = (InstanceRole.AGGREGATED,)


def most_at_once(reqs: list[ReqState]) -> int:
    """Most offline requests in the cluster at one time: from reaching it (`arrival_s`) to
    ending (`finish_s`); an end at the same instant as an entry frees the place first."""
    edges = sorted(
        [(r.arrival_s, 1) for r in reqs] + [(r.finish_s or 0.0, -1) for r in reqs],
    )
    now = most = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def test_cap_of_two_admits_ten_simultaneous_lines_two_at_a_time() -> None:
    lines = [req(f"l{k}", 0.0, 50, 4, OFF) for k in range(10)]
    sim = Simulator(
        [make_setup()], make_policy_for("aggregated", AGG), batch_max_inflight=2, check=True
    )
    rec = sim.run(lines)
    assert len(rec.requests) == 10
    assert all(r.phase is Phase.FINISHED for r in rec.requests)
    assert all(r.num_output_tokens == 4 for r in rec.requests)
    assert most_at_once(rec.requests) == 2
    assert rec.num_batch_queued == 0
    # FIFO: the lines reach the cluster in the order they were submitted
    entered = sorted(rec.requests, key=lambda r: (r.arrival_s, int(r.req_id[1:])))
    assert [r.req_id for r in entered] == [f"l{k}" for k in range(10)]
    assert max(r.arrival_s for r in rec.requests) > 0.0  # the later ones waited


def test_no_cap_lets_every_line_in_at_once() -> None:
    lines = [req(f"l{k}", 0.0, 50, 4, OFF) for k in range(10)]
    rec = Simulator([make_setup()], make_policy_for("aggregated", AGG)).run(lines)
    assert all(r.phase is Phase.FINISHED for r in rec.requests)
    assert most_at_once(rec.requests) == 10


def test_online_requests_do_not_wait_for_batch_places() -> None:
    lines = [req(f"l{k}", 0.0, 50, 20, OFF) for k in range(4)]
    sim = Simulator([make_setup()], make_policy_for("aggregated", AGG), batch_max_inflight=1)
    rec = sim.run([*lines, req("on", 0.1, 10, 2)])
    on = next(r for r in rec.requests if r.req_id == "on")
    assert on.arrival_s == pytest.approx(0.1)
    assert on.phase is Phase.FINISHED
    assert most_at_once([r for r in rec.requests if not r.is_online]) == 1


def test_config_cap_reaches_the_simulator_and_slows_a_burst() -> None:
    cfg = load_config(
        "configs/ooco.yaml",
        ("offline.arrival=uniform", "offline.rate=40", "offline.max_output_tokens=64"),
    )
    cfg = dataclasses.replace(cfg, duration_s=3.0, online=None)
    free = simulate(cfg, "ooco").requests
    assert cfg.batch_max_inflight is None  # no cap unless configured
    # `tidal sim ... --set batch_max_inflight=4` sets it the same way
    set_cfg = load_config("configs/ooco.yaml", ("batch_max_inflight=4",))
    assert set_cfg.batch_max_inflight == 4
    capped = simulate(dataclasses.replace(cfg, batch_max_inflight=4), "ooco").requests
    assert len(free) == len(capped) == 120
    assert all(r.phase is Phase.FINISHED for r in capped)
    assert most_at_once(free) > 4
    assert most_at_once(capped) <= 4


def test_bad_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_max_inflight"):
        dataclasses.replace(load_config("configs/ooco.yaml"), batch_max_inflight=0)
    with pytest.raises(ValueError, match="in flight"):
        Simulator([make_setup()], make_policy_for("aggregated", AGG), batch_max_inflight=0)
