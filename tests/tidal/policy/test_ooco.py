"""OOCO algorithms on hand-worked states (papers/ooco.md §3.2–3.4)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.perf.api import BatchShape
from tidal.perf.linear import LinearStepModel
from tidal.policy.batch_shape import decode_shape
from tidal.policy.ooco import (
    DecodeCandidate,
    InstanceRole,
    PrefKind,
    Stage,
    StrictView,
    can_place,
    choose_push_target,
    choose_victims,
    gate_offline_prefill,
    layer_preemption_delay_s,
    length_preference,
    select_for_pull,
    select_mix_decode,
    should_preempt_offline,
)
from tidal.policy.ooco.config import OocoConfig

# step_s = 10 ms + 10 µs per KV token: a step of 1000 KV tokens takes 20 ms.
CTX_MODEL = LinearStepModel(base_s=0.01, per_token_s=0.0, per_ctx_token_s=1e-5, per_attn_pair_s=0)


def reqs(prefix: str, lens: list[int]) -> list[DecodeCandidate]:
    return [DecodeCandidate(f"{prefix}{i}", n) for i, n in enumerate(lens)]


def test_table1_placement() -> None:
    # OOCO Table 1: relaxed hosts every prefill and offline decode; strict hosts decodes only.
    assert can_place(InstanceRole.RELAXED, True, Stage.PREFILL)
    assert not can_place(InstanceRole.RELAXED, True, Stage.DECODE)
    assert can_place(InstanceRole.RELAXED, False, Stage.PREFILL)
    assert can_place(InstanceRole.RELAXED, False, Stage.DECODE)
    assert not can_place(InstanceRole.STRICT, True, Stage.PREFILL)
    assert can_place(InstanceRole.STRICT, True, Stage.DECODE)
    assert not can_place(InstanceRole.STRICT, False, Stage.PREFILL)
    assert can_place(InstanceRole.STRICT, False, Stage.DECODE)


def test_layer_preemption_waits_for_next_layer_boundary() -> None:
    # 28 layers in 0.28 s -> 10 ms per layer; 105 ms in, the 11th boundary is at 110 ms.
    assert layer_preemption_delay_s(0.28, 0.105, 28) == pytest.approx(0.005)
    assert layer_preemption_delay_s(0.28, 0.3, 28) == 0.0
    assert should_preempt_offline(InstanceRole.RELAXED, True, 1)
    assert not should_preempt_offline(InstanceRole.RELAXED, False, 1)
    assert not should_preempt_offline(InstanceRole.STRICT, True, 1)


def test_alg2_picks_exactly_the_sorted_prefix_that_fits() -> None:
    # SLO 20.5 ms -> at most 1050 KV tokens. Online 300; offline sorted 50,100,200,400,500:
    # 300+50+100+200 = 650 fits, +400 = 1050 fits, +500 does not.
    online = reqs("on", [300])
    offline = reqs("off", [500, 100, 200, 50, 400])
    sel = select_mix_decode(CTX_MODEL, online, offline, 0.0205, 0, random.Random(0))
    assert sel.online == ["on0"]
    assert sel.offline == ["off3", "off1", "off2", "off4"]
    assert sel.step_s == pytest.approx(0.0205)
    # Tighter SLO (19 ms -> 900 tokens): only 50,100,200 (650); 400 would make 1050.
    sel = select_mix_decode(CTX_MODEL, online, offline, 0.019, 0, random.Random(0))
    assert sel.offline == ["off3", "off1", "off2"]


def test_alg2_random_probes_then_sorted_prefix() -> None:
    online = reqs("on", [300])
    offline = reqs("off", [500, 100, 200, 50, 400])
    rng = random.Random(7)
    probe = random.Random(7).sample(range(5), 2)
    sel = select_mix_decode(CTX_MODEL, online, offline, 0.019, 2, rng)
    # Hand replay: probes kept while the total stays <= 900, then the sorted remainder.
    total, expect = 300, []
    for i in probe:
        if total + offline[i].context_tokens <= 900:
            total += offline[i].context_tokens
            expect.append(offline[i].req_id)
    for r in sorted(
        (offline[i] for i in range(5) if i not in probe), key=lambda r: r.context_tokens
    ):
        if total + r.context_tokens > 900:
            break
        total += r.context_tokens
        expect.append(r.req_id)
    assert sel.offline == expect


@settings(max_examples=60, deadline=None)
@given(
    on=st.lists(st.integers(1, 400), max_size=4),
    off=st.lists(st.integers(1, 800), max_size=30),
    k=st.integers(0, 5),
    seed=st.integers(0, 1000),
)
def test_alg2_never_exceeds_slo_and_is_prefix_maximal(
    on: list[int], off: list[int], k: int, seed: int
) -> None:
    slo = 0.03  # 2000 KV tokens
    sel = select_mix_decode(
        CTX_MODEL, reqs("on", on), reqs("off", off), slo, k, random.Random(seed)
    )
    if sum(on) > 2000:
        assert sel.online_over_slo and not sel.offline
        return
    chosen = {r: n for r, n in zip((f"off{i}" for i in range(len(off))), off, strict=True)}
    used = sum(on) + sum(chosen[r] for r in sel.offline)
    assert used <= 2000
    assert len(set(sel.offline)) == len(sel.offline)
    if k == 0:  # no probes: every unchosen request is at least as long as every chosen one
        left = [n for r, n in chosen.items() if r not in set(sel.offline)]
        if left:
            assert used + min(left) > 2000


def test_overload_modes() -> None:
    online = reqs("on", [900, 100, 500])  # 1500 tokens -> 25 ms > 20 ms
    offline = reqs("off", [10])
    be = select_mix_decode(CTX_MODEL, online, offline, 0.02, 0, random.Random(0), "best-effort")
    assert be.online_over_slo and be.online == ["on0", "on1", "on2"] and not be.offline
    sac = select_mix_decode(CTX_MODEL, online, offline, 0.02, 0, random.Random(0), "sacrifice")
    # Shortest first: 100 + 500 = 600 fits within 1000; 900 is sacrificed.
    assert sac.online == ["on1", "on2"] and sac.sacrificed == ["on0"] and not sac.offline


# Alg. 1: 10 ms + 1 ms per token + 10 µs per KV token.
ALG1_MODEL = LinearStepModel(base_s=0.01, per_token_s=1e-3, per_ctx_token_s=1e-5, per_attn_pair_s=0)


def test_alg1_shortest_preference_below_saturation() -> None:
    batch = decode_shape([1000, 1000])  # L = 10 + 2 + 20 = 32 ms
    # Saturation at 8 needs 6 more; even at 300 tokens each: 10+8+10*(2000+1800)/1000 = 56 ms.
    pref = length_preference(ALG1_MODEL, batch, True, 0.0505, 0.9, 8, 100_000, 300, 32768)
    assert pref is not None and pref.kind is PrefKind.SHORTEST and pref.target_tokens == 300


def test_alg1_saturating_group_gets_longest_permissible_length() -> None:
    batch = decode_shape([1000, 1000])
    # 6 requests of ℓ: 10 + 8 + 0.01*(2000 + 6ℓ) <= 50.5 ms -> 6ℓ <= 1250 -> ℓ = 208.
    pref = length_preference(ALG1_MODEL, batch, True, 0.0505, 0.9, 8, 100_000, 100, 32768)
    assert pref is not None and pref.kind is PrefKind.SATURATE
    assert (pref.target_tokens, pref.group_size) == (208, 6)


def test_alg1_saturated_prefers_longest_fit_capped_by_memory() -> None:
    batch = decode_shape([1000, 1000])
    # bs_sat = 2 reached: 10 + 3 + 0.01*(2000+ℓ) <= 50.5 -> ℓ <= 1750; only 1000 tokens free.
    pref = length_preference(ALG1_MODEL, batch, True, 0.0505, 0.9, 2, 1000, 10, 32768)
    assert pref is not None and (pref.kind, pref.target_tokens) == (PrefKind.LONGEST_FIT, 1000)
    pref = length_preference(ALG1_MODEL, batch, True, 0.0505, 0.9, 2, 100_000, 10, 32768)
    assert pref is not None and pref.target_tokens == 1750


def test_alg1_no_pull_without_slack_or_when_requests_left_out() -> None:
    batch = decode_shape([1000, 1000])  # 32 ms
    assert length_preference(ALG1_MODEL, batch, False, 0.0505, 0.9, 8, 10**5, 1, 32768) is None
    # margin: 32 ms >= 0.9 * 35 ms.
    assert length_preference(ALG1_MODEL, batch, True, 0.035, 0.9, 8, 10**5, 1, 32768) is None


def test_pull_selects_closest_to_preference_within_slo() -> None:
    from tidal.policy.ooco import LengthPreference

    pref = LengthPreference(PrefKind.SATURATE, 200, 6)
    cands = reqs("r", [1000, 210, 190, 50, 205])
    batch = decode_shape([1000, 1000])  # 32 ms; +each req 1 ms + 10 µs/token
    # Closest to 200: 205 (+3.05 ms), 190, 210 -> 32+3.05+2.9+3.1 = 41.05 ms; 50 -> 42.55 ms;
    # the SLO of 42 ms stops at three.
    got = select_for_pull(ALG1_MODEL, pref, cands, batch, 0.042, 10**5, 10)
    assert got == ["r4", "r2", "r1"]


def test_eviction_by_bottleneck() -> None:
    offline = reqs("o", [100, 800, 300, 500])
    # Compute-bound: longest first -> one victim frees 800 >= 600.
    assert choose_victims(600, offline, compute_bound=True) == ["o1"]
    # Memory-bound: shortest first -> 100 + 300 + 500 = 900 >= 600.
    assert choose_victims(600, offline, compute_bound=False) == ["o0", "o2", "o3"]
    assert choose_victims(5000, offline, compute_bound=False) is None


def test_push_prefers_free_space_then_cheapest_eviction() -> None:
    a = StrictView("a", 500, reqs("a", [400, 400]), 2)
    b = StrictView("b", 900, reqs("b", [100]), 1)
    assert choose_push_target(800, [a, b], 256).instance_id == "b"  # type: ignore[union-attr]
    d = choose_push_target(1000, [a, b], 256)
    # a needs 500 more -> evicts 400+400 (800 lost); b needs 100 -> evicts 100 (100 lost).
    assert d is not None and d.instance_id == "b" and d.evict == ["b0"]
    assert choose_push_target(5000, [a, b], 256) is None


def test_gating_cost_model() -> None:
    m = ALG1_MODEL
    # Empty decode batch: nothing to lose by prefilling.
    assert gate_offline_prefill(m, BatchShape(), 1000, 100, 10**6, 1e4).admit
    # Small batch, no online pressure: the bigger batch is cheaper per token -> admit.
    small = decode_shape([1000, 1000])
    assert gate_offline_prefill(m, small, 1000, 100, 10**6, 0.0).admit
    # Heavy online KV inflow on a nearly full node: eviction is likely and recompute dominates.
    d = gate_offline_prefill(m, small, 1000, 100, 1200, 1e6)
    assert not d.admit and d.expected_recompute_s > d.gain_s
    # Not enough KV at all.
    assert not gate_offline_prefill(m, small, 1000, 100, 500, 0.0).admit


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="num_random_probes"):
        OocoConfig(num_random_probes=-1)
    with pytest.raises(ValueError, match="overload_mode"):
        OocoConfig(overload_mode="drop")  # type: ignore[arg-type]
