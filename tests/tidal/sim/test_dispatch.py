"""The serving path in front of the scheduler (`Simulator(dispatch_s=, dispatch_s_per_token=)`,
`ClusterConfig.dispatch_ms`): a request is routed that long after it arrives, and its TTFT counts
from its arrival."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tidal.sim.test_core import make_policy_for, make_setup, req
from tidal.config.cluster import load_config
from tidal.policy import InstanceRole
from tidal.sim.build import simulate
from tidal.sim.core import Simulator

AGG = (InstanceRole.AGGREGATED,)


def test_dispatch_delay_adds_to_ttft_from_arrival() -> None:
    # step = 0.01 + 0.001 * tokens; routed at 0.5 + 0.02 + 100 * 1e-4 = 0.53, prefill 0.11
    sim = Simulator(
        [make_setup()],
        make_policy_for("aggregated", AGG),
        dispatch_s=0.02,
        dispatch_s_per_token=1e-4,
    )
    (a,) = sim.run([req("a", 0.5, 100, 2)]).requests
    assert a.arrival_s == 0.5
    assert a.first_token_s == pytest.approx(0.53 + 0.11)


def test_per_token_dispatch_can_reorder_arrivals() -> None:
    # long arrives first (t=0) but is routed at 1000 * 1e-3 = 1.0; short (t=0.1, 10 tokens) is
    # routed at 0.11 and runs alone: prefill 0.01 + 0.001 * 10 = 0.02
    sim = Simulator([make_setup()], make_policy_for("aggregated", AGG), dispatch_s_per_token=1e-3)
    rec = sim.run([req("long", 0.0, 1000, 1), req("short", 0.1, 10, 1)])
    got = {r.req_id: r for r in rec.requests}
    assert got["short"].first_token_s == pytest.approx(0.11 + 0.02)
    assert got["long"].start_s is not None and got["long"].start_s >= 1.0
    assert got["long"].arrival_s == 0.0


def test_no_dispatch_is_the_old_simulator() -> None:
    cfg = dataclasses.replace(load_config("configs/ooco.yaml"), duration_s=5.0)
    base = simulate(cfg, "ooco")
    zero = simulate(dataclasses.replace(cfg, dispatch_ms=0.0, dispatch_us_per_token=0.0), "ooco")
    assert [r.first_token_s for r in base.requests] == [r.first_token_s for r in zero.requests]
    slow = simulate(dataclasses.replace(cfg, dispatch_ms=30.0), "ooco")
    b = {r.req_id: r.first_token_s for r in base.requests}
    later = [
        r.first_token_s - b[r.req_id] for r in slow.requests if r.first_token_s and b[r.req_id]
    ]
    assert later and min(later) >= 0.03 - 1e-9


@pytest.mark.parametrize("bad", [{"dispatch_ms": -1.0}, {"dispatch_us_per_token": -0.5}])
def test_negative_dispatch_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="dispatch"):
        dataclasses.replace(load_config("configs/ooco.yaml"), **bad)  # type: ignore[arg-type]


def test_simulator_refuses_negative_dispatch() -> None:
    with pytest.raises(ValueError, match="dispatch"):
        Simulator([make_setup()], make_policy_for("aggregated", AGG), dispatch_s=-0.1)


def test_overlapping_transfers_share_the_link() -> None:
    # Two prefills of 100 tokens on P: a first token at 0.11; b (routed behind a) at 0.22.
    # KV 100 tokens * 1000 B over 1e6 B/s = 0.1 s each. a's bytes take the link 0.11 -> 0.21;
    # b's start at 0.22 (the link is free again) -> 0.32. With a 0.5 s link latency instead,
    # a's bytes wait for it (0.61 -> 0.71) and b's for a's (0.72 -> 0.82 vs 0.72 alone).
    roles = (InstanceRole.PREFILL, InstanceRole.DECODE)
    pol = make_policy_for("pd-disagg", roles)
    sim = Simulator([make_setup(r) for r in roles], pol, link_bytes_per_s=1e6)
    rec = sim.run([req("a", 0.0, 100, 2), req("b", 0.0, 100, 2)])
    got = {r.req_id: r for r in rec.requests}
    assert got["a"].finish_s == pytest.approx(0.21 + 0.011)
    # b's one decode step on D waits for a's (0.21 -> 0.221 runs a alone) then lands at 0.32
    assert got["b"].finish_s == pytest.approx(0.32 + 0.011)


def test_concurrent_transfers_share_the_links_bytes_not_the_latency() -> None:
    # Prefills of 100 tokens, one a step: first tokens at 0.11 (a) and 0.22 (b). KV 100 tokens
    # * 1000 B over 1e5 B/s = 1 s each, after a 0.05 s fixed part (in parallel): a's bytes move
    # alone 0.16 -> 0.27 (0.11 s of its 1 s), then both at half rate: a's last 0.89 s of bytes
    # take 1.78 s -> 2.05; b moved 0.89 s' worth by then, its last 0.11 alone -> 2.16 (the same
    # moment as one after the other; alone they would land at 1.16 and 1.27).
    roles = (InstanceRole.PREFILL, InstanceRole.DECODE)
    pol = make_policy_for("pd-disagg", roles)
    sim = Simulator([make_setup(r) for r in roles], pol, link_bytes_per_s=1e5, link_latency_s=0.05)
    rec = sim.run([req("a", 0.0, 100, 1000), req("b", 0.0, 100, 1000)])
    firsts = sorted(r.first_token_s for r in rec.requests if r.first_token_s is not None)
    assert firsts == [pytest.approx(0.11), pytest.approx(0.22)]
    got = {r.req_id: r.queued_s for r in rec.requests}
    assert got == {"a": pytest.approx(2.05), "b": pytest.approx(2.16)}


def test_a_short_transfer_is_not_queued_behind_a_long_one() -> None:
    # long: 1000 tokens, prefill 0.01 + 1.0 (chunk 2048) -> 1.01; its KV 1e6 B at 1e6 B/s moves
    # 1.01 -> ... short (10 tokens, prefill 0.02) first token at 1.03, its 1e4 B on the link from
    # 1.03 at half rate: 0.02 s -> 1.05 (after the long one: 2.03). The long one lost 0.01 s of
    # bytes to it: 1.01 + 1.0 + 0.01 = 2.02. (No fixed part: link latency 0.)
    roles = (InstanceRole.PREFILL, InstanceRole.DECODE)
    pol = make_policy_for("pd-disagg", roles)
    setups = [make_setup(r, chunk_size=2048) for r in roles]
    sim = Simulator(setups, pol, link_bytes_per_s=1e6, check=True)
    rec = sim.run([req("long", 0.0, 1000, 50), req("short", 0.0, 10, 50)])
    got = {r.req_id: r.queued_s for r in rec.requests}
    assert got == {"long": pytest.approx(2.02), "short": pytest.approx(1.05)}
