"""TaiChi algorithms on hand-worked states (papers/taichi.md §3.3–3.4)."""

from __future__ import annotations

import pytest

from tidal.perf.api import BatchShape
from tidal.perf.linear import LinearStepModel
from tidal.policy.taichi import (
    DecodeHost,
    FlowReq,
    PrefillTarget,
    TaichiConfig,
    choose_decode_host,
    estimate_prefill_s,
    route_prefill,
    select_backflow,
    select_degrading,
)

TOK = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)
IDLE = BatchShape()


def p_heavy(queue: list[int]) -> PrefillTarget:
    return PrefillTarget(0, True, 1000, queue, IDLE, TOK)


def d_heavy(queue: list[int]) -> PrefillTarget:
    return PrefillTarget(1, False, 100, queue, IDLE, TOK)


def test_estimate_sums_chunks() -> None:
    # 250 tokens in chunks of 100: 2 x (10 + 10 ms) + (10 + 5 ms) = 55 ms.
    assert estimate_prefill_s(TOK, 250, 100, IDLE) == pytest.approx(0.055)


def test_short_request_degrades_to_d_heavy_when_feasible() -> None:
    # 200 tokens: D-heavy 2 x 20 ms = 40 ms; P-heavy 30 ms + 10 ms transfer. Both feasible; the
    # P-heavy queue holds 500 tokens, the D-heavy none -> D-heavy (line 11).
    assert route_prefill(200, [p_heavy([500]), d_heavy([])], 1.0, 0.01) == 1


def test_long_request_goes_to_p_heavy_when_d_heavy_is_infeasible() -> None:
    # 5000 tokens: D-heavy 50 x 20 ms = 1 s > 0.7 s. P-heavy: queue 500 -> 60 ms, own 5 x 110 ms,
    # transfer 10 ms: 0.62 s < 0.7 s.
    assert route_prefill(5000, [p_heavy([500]), d_heavy([])], 0.7, 0.01) == 0


def test_no_feasible_instance_returns_none() -> None:
    assert route_prefill(5000, [p_heavy([500]), d_heavy([])], 0.1, 0.01) is None


def test_least_queued_p_heavy_wins_over_loaded_d_heavy() -> None:
    # Both feasible; D-heavy already holds 300 queued tokens, P-heavy 0 -> no need to degrade.
    assert route_prefill(100, [p_heavy([]), d_heavy([300])], 1.0, 0.0) == 0


def test_degrading_longest_first_until_below_watermark() -> None:
    reqs = [FlowReq("a", 10, 0.05, 30), FlowReq("b", 400, 0.05, 20), FlowReq("c", 90, 0.05, 25)]
    # 100 blocks, watermark 0.5 -> limit 50; used 96: remove b (76 left), then c (51), then a.
    assert select_degrading(reqs, 96, 100, 0.5) == ["b", "c", "a"]
    assert select_degrading(reqs, 70, 100, 0.5) == ["b"]  # 70 - 20 = 50 <= 50
    assert select_degrading(reqs, 50, 100, 0.5) == []


def test_backflow_above_alpha_times_slo() -> None:
    reqs = [FlowReq("a", 10, 0.095, 1), FlowReq("b", 10, 0.097, 1), FlowReq("c", 10, 0.2, 1)]
    assert select_backflow(reqs, 0.1, 0.96) == ["c", "b"][::-1]


def test_decode_init_in_place_or_least_used_d_heavy() -> None:
    hosts = [DecodeHost(2, 0.7, 100), DecodeHost(3, 0.4, 5), DecodeHost(4, 0.5, 100)]
    assert choose_decode_host(1, True, hosts, 10) == 1  # prefilled on D-heavy: stay
    assert choose_decode_host(0, False, hosts, 10) == 4  # 3 is emptier but lacks room
    assert choose_decode_host(0, False, hosts, 1000) is None


def test_config_sliders() -> None:
    assert TaichiConfig().p_heavy_count(4) == 2
    assert TaichiConfig(num_p_heavy=1).p_heavy_count(4) == 1
    with pytest.raises(ValueError, match="memory_watermark"):
        TaichiConfig(memory_watermark=1.5)


def test_sliders_default_to_the_configured_chunk_sizes() -> None:
    from tidal.perf.linear import LinearStepModel
    from tidal.policy.base import PolicyContext
    from tidal.policy.registry import make_policy
    from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Slo

    roles = (InstanceRole.P_HEAVY, InstanceRole.D_HEAVY)
    insts = [
        InstanceState(i, r, c, 256, 16, 1000, 1000, LinearStepModel(), 1, 1e9)
        for i, (r, c) in enumerate(zip(roles, (1024, 128), strict=True))
    ]
    cluster = ClusterView(insts, [], 1e9)
    slo = Slo(3.0, 0.1)
    kept = make_policy("taichi", PolicyContext(2, roles, slo, {}, seed=0)).tick(cluster, 0.0)
    assert kept.set_chunk_size == {}  # the experiment's S_p = 1024 and S_d = 128 stay
    params = {"chunk_p": 2048, "chunk_d": 256}
    given = make_policy("taichi", PolicyContext(2, roles, slo, params, seed=0)).tick(cluster, 0.0)
    assert given.set_chunk_size == {0: 2048, 1: 256}
