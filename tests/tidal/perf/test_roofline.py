from __future__ import annotations

import dataclasses

import pytest

from tidal.perf.api import BatchShape
from tidal.perf.catalog import hardware_spec, model_spec
from tidal.perf.roofline import Bottleneck, RooflineModel, RooflineParams


def test_prefill_step_hand_worked(toy_model, toy_params) -> None:
    m = RooflineModel(toy_model, toy_params)
    b = BatchShape(num_prefill_tokens=10, num_prefill_reqs=1, prefill_attn_pairs=100)
    # Per layer, N=10, F=1000 FLOP/s, M=100 B/s, d=2; each GEMM max(2·N·Din·Dout/F, d·(...)/M):
    # QKV 8x16: max(2560/1000, 2·(80+128+160)/100) = max(2.56, 7.36) = 7.36
    # O   8x8 : max(1280/1000, 2·(80+64+80)/100)   = max(1.28, 4.48) = 4.48
    # up  8x32: max(5120/1000, 2·(80+256+320)/100) = max(5.12, 13.12) = 13.12
    # down16x8: max(2560/1000, 2·(160+128+80)/100) = max(2.56, 7.36) = 7.36   -> GEMMs 32.32
    # prefill attention: max(4·8·100/1000, 2·2·(8+4)·10/100) = max(3.2, 4.8) = 4.8
    # 2 layers · 37.12 = 74.24; LM head (1 seq, 8x32): max(512/1000, 2·(40+256)/100) = 5.92
    # + O_p 1.0 = 81.16
    assert m.step_s(b) == pytest.approx(81.16)


def test_decode_step_hand_worked(toy_model, toy_params) -> None:
    m = RooflineModel(toy_model, toy_params)
    b = BatchShape(num_decode_reqs=3, decode_context_tokens=30)
    # N=3: QKV max(.768, 2·(24+128+48)/100=4.0); O max(.384, 2.24); up max(1.536, 7.52);
    # down max(.768, 4.0) -> 17.76. Decode attention: max(4·8·30/1000=.96,
    # 2·2·(4·30 + 8·3)/100 = 5.76) = 5.76. 2 layers · 23.52 = 47.04;
    # LM head (3 seqs): max(1.536, 2·(3·40+256)/100 = 7.52) = 7.52; + O_d 0.5 = 55.06
    assert m.step_s(b) == pytest.approx(55.06)


def test_fixed_part_is_the_lm_head_and_the_overhead(toy_model, toy_params) -> None:
    """`fixed_s`: what a step runs once, not per layer (the simulator charges it again to a step
    resuming a layer-cut chunk): the hand-worked steps above less their 2 layers."""
    m = RooflineModel(toy_model, toy_params)
    pre = BatchShape(num_prefill_tokens=10, num_prefill_reqs=1, prefill_attn_pairs=100)
    dec = BatchShape(num_decode_reqs=3, decode_context_tokens=30)
    assert m.fixed_s(pre) == pytest.approx(5.92 + 1.0)  # LM head + O_p
    assert m.fixed_s(dec) == pytest.approx(7.52 + 0.5)  # LM head + O_d
    assert m.fixed_s(BatchShape()) == 0.0


def test_empty_batch_costs_nothing(toy_model, toy_params) -> None:
    assert RooflineModel(toy_model, toy_params).step_s(BatchShape()) == 0.0


def test_tensor_parallel_comm_term(toy_model, toy_params) -> None:
    b = BatchShape(num_prefill_tokens=10, num_prefill_reqs=1, prefill_attn_pairs=100)
    slow = RooflineModel(toy_model, toy_params, tp=2)
    fast = RooflineModel(toy_model, dataclasses.replace(toy_params, B_c=1e30), tp=2)
    # two ring all-reduces of N·h·d bytes per layer, each moving 2(tp-1)/tp = 1 times its
    # 10·8·2 = 160 bytes: 2 · 160 / (B_c = 1 B/s) = 320 per layer -> 2 layers = 640
    assert slow.step_s(b) - fast.step_s(b) == pytest.approx(640.0)


def test_bs_sat_hand_worked(toy_model, toy_params) -> None:
    m = RooflineModel(toy_model, dataclasses.replace(toy_params, M_g=1000.0))
    # Σ 2·Din·Dout = 2·(128+64+256+128) = 1152 FLOP/token -> a = 1.152 s/token
    # Σ d·(Din+Dout) = 2·(24+16+40+24) = 208 B/token -> b = .208; weights Σ d·Din·Dout = 1152 B
    # -> w = 1.152 s. Compute-bound once a·n >= b·n + w: n >= 1.152 / .944 = 1.22 -> 2
    assert m.bs_sat() == 2
    assert m.layer_gemm_s(2) == pytest.approx(2 * 1.152)  # at n=2 every GEMM is compute-bound


def test_bs_sat_matches_brute_force_on_a_real_model() -> None:
    m = RooflineModel(model_spec("qwen2.5-7b"), RooflineParams.from_hardware(hardware_spec("h100")))
    a = sum(x[0] for x in m._abw)
    b = sum(x[1] for x in m._abw)
    w = sum(x[2] for x in m._abw)
    n = m.bs_sat()
    assert a * n >= b * n + w
    assert a * (n - 1) < b * (n - 1) + w


def test_tile_quantisation_charges_a_full_tile(toy_model) -> None:
    p = RooflineParams(1.0, 1.0, 1.0, 1e30, 1e30, 0.0, 0.0, 1.0, tile_tokens=4)
    m = RooflineModel(toy_model, p)
    # compute-bound (M huge): 5 tokens cost like 8 (two tiles of 4), 8 like 8, 9 like 12
    assert m.layer_gemm_s(5) == pytest.approx(m.layer_gemm_s(8))
    assert m.layer_gemm_s(9) == pytest.approx(m.layer_gemm_s(12))
    assert m.layer_gemm_s(9) > m.layer_gemm_s(8)


def test_knee_approaches_eq1_max_and_is_slower_near_the_ridge(toy_model, toy_params) -> None:
    hard = RooflineModel(toy_model, toy_params)
    sharp = RooflineModel(toy_model, dataclasses.replace(toy_params, knee=200.0))
    soft = RooflineModel(toy_model, dataclasses.replace(toy_params, knee=2.0))
    for n in (1, 10, 100, 1000):
        assert sharp.layer_gemm_s(n) == pytest.approx(hard.layer_gemm_s(n), rel=1e-2)
        assert soft.layer_gemm_s(n) > hard.layer_gemm_s(n)


def test_per_shape_tables_scale_only_their_shape(toy_model, toy_params) -> None:
    # the QKV GEMM of the toy is 8x16 (tp=1): time x2 at N<=10, x1 at N>=20, linear between
    table = ((8.0, 16.0, ((10.0, 2.0), (20.0, 1.0))),)
    base = RooflineModel(toy_model, toy_params)
    tab = RooflineModel(toy_model, dataclasses.replace(toy_params, gemm_eff=table))
    for n, mult in ((5, 2.0), (15, 1.5), (40, 1.0)):
        b0, b1 = base.gemm_s(n), tab.gemm_s(n)
        assert b1[0] == pytest.approx(b0[0] * mult)
        assert b1[1:] == pytest.approx(b0[1:])


def test_analyze_classifies_bottlenecks() -> None:
    m = RooflineModel(model_spec("llama-2-7b"), RooflineParams.from_hardware(hardware_spec("a100")))
    prefill = BatchShape(num_prefill_tokens=2048, num_prefill_reqs=1, prefill_attn_pairs=2048**2)
    decode = BatchShape(num_decode_reqs=8, decode_context_tokens=8 * 2000)
    a = m.analyze(prefill)
    assert a.bottleneck is Bottleneck.COMPUTE
    assert a.step_s == pytest.approx(m.step_s(prefill))
    assert 0 < a.compute_util <= 1.0 + 1e-9
    assert m.analyze(decode).bottleneck is Bottleneck.BANDWIDTH
    assert m.analyze(decode, kv_capacity_tokens=16_000).bottleneck is Bottleneck.CAPACITY


def test_params_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        RooflineParams(0.0, 1, 1, 1, 1, 0, 0, 1)
    with pytest.raises(ValueError):
        RooflineParams(1, 1, 1, 1, 1, -1.0, 0, 1)
    with pytest.raises(ValueError):
        RooflineParams(1, 1, 1, 1, 1, 0, 0, 1, gemm_eff=((1.0, 1.0, ((5.0, 1.0), (2.0, 1.0))),))


def test_step_time_grows_with_work() -> None:
    m = RooflineModel(model_spec("yi-34b"), RooflineParams.from_hardware(hardware_spec("h800")), 4)
    prev = 0.0
    for n in (1, 16, 128, 1024, 4096):
        t = m.step_s(BatchShape(num_prefill_tokens=n, num_prefill_reqs=1, prefill_attn_pairs=n * n))
        assert t > prev
        prev = t


def test_gemm_memo_returns_what_the_formula_gives(toy_model, toy_params) -> None:
    m = RooflineModel(toy_model, toy_params)
    counts = [1, 7, 128, 512, 513, 2048, 0, -3]
    first = [m.layer_gemm_s(n) for n in counts]
    assert [m.layer_gemm_s(n) for n in counts] == first  # served from the memo
    assert first == [m._layer_gemm_s(n) for n in counts]  # same as computing afresh
    shape = BatchShape(num_prefill_tokens=300, num_prefill_reqs=1, prefill_attn_pairs=300 * 300)
    assert m.step_s(shape) == m.step_s(shape)
