from __future__ import annotations

import random

import pytest

from tidal.config.cluster import load_config
from tidal.perf import BatchShape, RooflineModel, RooflineParams, hardware_spec, model_spec
from tidal.perf.catalog import ModelSpec
from tidal.policy.state import Slo
from tidal.schemas.enums import RequestClass
from tidal.sim.build import simulate
from tidal.sim.limit import CpuAttnCapacity, config_limit, linear_floor, offline_limit
from tidal.sim.metrics import summarize
from tidal.workload.mix import SimRequest

# A one-layer, width-1 model whose roofline terms are round numbers (bytes_per_value 1, no
# gated MLP): GEMMs (1x3, 1x1, 1x1, 1x1) = 2*6 = 12 FLOP/token at F_g 12 -> 1 s per token;
# LM head max(2*1*1/F_g, 1*(1+1)/M_g) = max(1/6, 1/4) = 0.25 s per sequence; prefill attention
# 4/F_ap = 1 s per pair or 1*2*(1+1)/M_a = 1 s per prompt token; decode attention
# max(4/F_ad, 2/M_a) = max(0.25, 0.5) = 0.5 s per context token plus 2/M_a = 0.5 s per request;
# per step min(O_p, O_d) = 1 s.
TINY = ModelSpec("tiny", 1, 1, 1, 1, 1, 1, 1, bytes_per_value=1, gated_mlp=False)
TINY_PARAMS = RooflineParams(F_g=12, F_ap=4, F_ad=16, M_g=8, M_a=4, O_p=2, O_d=1, B_c=1)
SLO = Slo(ttft_s=10, tpot_s=5)


def _req(cls: RequestClass, arrival: float, inp: int, out: int) -> SimRequest:
    slo = SLO if cls is RequestClass.ONLINE else None
    return SimRequest(f"{cls.value}{arrival}", cls, arrival, inp, out, slo)


def test_floor_coefficients_of_the_tiny_model() -> None:
    f = linear_floor(RooflineModel(TINY, TINY_PARAMS))
    assert f.per_token_s == pytest.approx(1.0)
    assert f.per_seq_s == pytest.approx(0.25)
    assert f.prefill_pair_s == pytest.approx(1.0)
    assert f.prefill_token_attn_s == pytest.approx(1.0)
    assert (f.decode_ctx_s, f.decode_req_s) == (pytest.approx(0.5), pytest.approx(0.5))
    assert f.per_step_s == pytest.approx(1.0)


def test_limit_hand_computed() -> None:
    model = RooflineModel(TINY, TINY_PARAMS)
    off = [_req(RequestClass.OFFLINE, 0.0, 2, 3)]
    # Offline request, prompt 2, output 3: n = 2 + 2 = 4 GEMM tokens, pairs >= 2*3/2 = 3,
    # decode contexts 2 + 3 = 5, 3 sequences, KV capacity 10 -> 1/10 s per resident token:
    # 4*1 + 3*1 (pairs) + 2*0.5 (requests) + 3*0.25 + 2/10 + 5*(0.5 + 1/10) = 11.95 s / 3 tokens.
    only = offline_limit(model, 1, 10, 100.0, [], off)
    assert only.offline_s_per_token == pytest.approx(11.95 / 3)
    assert only.limit_tokens_per_s == pytest.approx(300 / 11.95 / 100)
    assert only.offline_only_tokens_per_s == only.limit_tokens_per_s
    # Online request, prompt 1, output 2, due at 0 + 10 + 1*5 = 15 s (inside the window):
    # 2*1 + 1 + 1*0.5 + 2*0.25 + 1/10 + 1*0.6 = 4.7 s. The one arriving at 95 s is due at 110 s:
    # not charged.
    on = [_req(RequestClass.ONLINE, 0.0, 1, 2), _req(RequestClass.ONLINE, 95.0, 1, 2)]
    lim = offline_limit(model, 1, 10, 100.0, on, off)
    assert lim.online_gpu_s == pytest.approx(4.7)
    assert lim.num_online_charged == 1
    assert lim.limit_tokens_per_s == pytest.approx((100 - 4.7) * 3 / 11.95 / 100)
    assert lim.share(lim.limit_tokens_per_s / 2) == pytest.approx(0.5)
    # A 50 % violation cap forgives one of the two: the charged one, the most expensive.
    forgiven = offline_limit(model, 1, 10, 100.0, on, off, violation_pct=50)
    assert forgiven.online_gpu_s == 0.0
    assert forgiven.limit_tokens_per_s == pytest.approx(only.limit_tokens_per_s)


def test_instances_sharing_fewer_devices_share_their_seconds() -> None:
    model = RooflineModel(TINY, TINY_PARAMS)
    off = [_req(RequestClass.OFFLINE, 0.0, 2, 3)]
    on = [_req(RequestClass.ONLINE, 0.0, 1, 2)]
    # 2 instances on 1 device: 100 device-seconds, as 1 instance has; on 2 or more: 200
    shared = offline_limit(model, 2, 10, 100.0, on, off, num_devices=1)
    assert shared.gpu_s == 100.0
    assert shared.limit_tokens_per_s == pytest.approx((100 - 4.7) * 3 / 11.95 / 100)
    assert offline_limit(model, 2, 10, 100.0, on, off, num_devices=4).gpu_s == 200.0
    assert offline_limit(model, 2, 10, 100.0, on, off).gpu_s == 200.0
    with pytest.raises(ValueError, match="num_devices"):
        offline_limit(model, 2, 10, 100.0, on, off, num_devices=0)


def test_cpu_workers_credit_at_most_their_bandwidth_or_all_decode_attention() -> None:
    model = RooflineModel(TINY, TINY_PARAMS)
    off = [_req(RequestClass.OFFLINE, 0.0, 2, 3)]
    on = [_req(RequestClass.ONLINE, 0.0, 1, 2)]
    # 1 B/s for 100 s at 1 B per token: 100 context tokens, each saving 0.5 + 1/10 s -> 60 s.
    # Bandwidth cap: (100 - 4.7 + 60) / (11.95/3) = 38.99 tokens. All offline decode attention
    # (5 * 0.6 = 3 s of 11.95) and the online's (0.6 s) gone: (100 - 4.1) / (11.95/3 - 1)
    # = 32.15 tokens: the smaller wins.
    lim = offline_limit(model, 1, 10, 100.0, on, off, cpu=CpuAttnCapacity(1, 1.0, 1.0))
    assert lim.cpu_credit_s == pytest.approx(60.0)
    assert lim.limit_tokens_per_s == pytest.approx((100 - 4.1) / (11.95 / 3 - 1) / 100)


def test_the_slo_pace_binds_where_kv_is_plentiful() -> None:
    # KV capacity 10^6: point 2 charges step overhead ~nothing. Online prompt 1, output 5, due
    # at 0 + 10 + 4*5 = 30 s, needs 5 steps (the prefill's and 4 decodes) inside [0, 30]:
    # P = 5, F P = 5 s. Its floor without the F/K terms: 5 GEMM tokens + 1 pair + 4*0.5
    # (requests) + 5*0.25 + context 4 + 6 = 10 tokens * 0.5 = 14.25 s; the offline request's
    # 11.95 - 0.2 - 5*0.1 = 11.25 s / 3 tokens.
    model = RooflineModel(TINY, TINY_PARAMS)
    off = [_req(RequestClass.OFFLINE, 0.0, 2, 3)]
    on = [_req(RequestClass.ONLINE, 0.0, 1, 5)]
    lim = offline_limit(model, 1, 10**6, 100.0, on, off)
    assert lim.binding == "pacing" and lim.paced_steps == 5
    assert lim.paced_gpu_s == pytest.approx(5.0)
    assert lim.online_gpu_s == pytest.approx(14.25 + 5.0)
    assert lim.limit_tokens_per_s == pytest.approx((100 - 19.25) * 3 / 11.25 / 100)
    assert lim.pacing_bound_tokens_per_s == lim.limit_tokens_per_s
    assert lim.kv_bound_tokens_per_s == pytest.approx((100 - 14.25) * 3 / 11.25 / 100, rel=1e-4)
    assert lim.limit_tokens_per_s < lim.kv_bound_tokens_per_s < lim.offline_only_tokens_per_s
    # a second request one second later shares the steps: still 5
    two = offline_limit(model, 1, 10**6, 100.0, [*on, _req(RequestClass.ONLINE, 1.0, 1, 5)], off)
    assert two.paced_steps == 5
    # without an SLO nothing is paced: point 2's bound alone, as before
    free = [SimRequest("x", RequestClass.ONLINE, 0.0, 1, 5, None)]
    unpaced = offline_limit(model, 1, 10**6, 100.0, free, off)
    assert (unpaced.binding, unpaced.paced_steps, unpaced.pacing_bound_tokens_per_s) == (
        "kv",
        0,
        None,
    )
    assert unpaced.limit_tokens_per_s == unpaced.kv_bound_tokens_per_s
    assert unpaced.limit_tokens_per_s == pytest.approx(lim.kv_bound_tokens_per_s)


def test_forgiven_requests_take_their_steps_with_them() -> None:
    # Two disjoint paced requests, 5 and 3 steps: P = 8. Forgiving one (50 % of 2) may drop
    # the larger demand: P >= 8 - 5 = 3; the cost side drops the more expensive request.
    model = RooflineModel(TINY, TINY_PARAMS)
    off = [_req(RequestClass.OFFLINE, 0.0, 2, 3)]
    on = [_req(RequestClass.ONLINE, 0.0, 1, 5), _req(RequestClass.ONLINE, 50.0, 1, 3)]
    assert offline_limit(model, 1, 10**6, 100.0, on, off).paced_steps == 8
    forgiven = offline_limit(model, 1, 10**6, 100.0, on, off, violation_pct=50)
    assert forgiven.paced_steps == 3 and forgiven.binding == "pacing"
    # the output-3 request alone: 3 + 1 + 2*0.5 + 0.75 + (2 + 1)*0.5 = 7.25 s, plus 3 steps
    assert forgiven.online_gpu_s == pytest.approx(7.25 + 3.0)
    # all forgiven: nothing paced, nothing charged
    gone = offline_limit(model, 1, 10**6, 100.0, on, off, violation_pct=100)
    assert (gone.paced_steps, gone.online_gpu_s, gone.binding) == (0, 0.0, "kv")


def test_cpu_workers_credit_no_paced_step() -> None:
    # 100 context tokens streamed: against the pacing bound each saves its attention, 0.5 s,
    # not step overhead: credit 50 s, against point 2's 50 + 100 * 1e-6.
    model = RooflineModel(TINY, TINY_PARAMS)
    off = [_req(RequestClass.OFFLINE, 0.0, 2, 3)]
    on = [_req(RequestClass.ONLINE, 0.0, 1, 5)]
    lim = offline_limit(model, 1, 10**6, 100.0, on, off, cpu=CpuAttnCapacity(1, 1.0, 1.0))
    assert lim.binding == "pacing" and lim.cpu_credit_s == pytest.approx(50.0)
    # bandwidth cap (100 - 19.25 + 50) / 3.75; all attention gone (online 5 s, offline 2.5 s of
    # 11.25): (100 - 14.25) / (3.75 - 2.5/3): the smaller
    assert lim.limit_tokens_per_s == pytest.approx((100 - 14.25) / (3.75 - 2.5 / 3) / 100)


def test_limit_stays_under_offline_only_capacity_on_random_loads() -> None:
    rng = random.Random(1)
    model = RooflineModel(TINY, TINY_PARAMS)
    off = [_req(RequestClass.OFFLINE, 0.0, rng.randint(1, 9), rng.randint(1, 9)) for _ in range(5)]
    for _ in range(40):
        on = [
            _req(RequestClass.ONLINE, rng.uniform(0, 90), rng.randint(1, 5), rng.randint(1, 12))
            for _ in range(rng.randint(0, 6))
        ]
        kv, pct = rng.choice((10, 10**6)), rng.choice((0.0, 20.0))
        lim = offline_limit(model, rng.randint(1, 2), kv, 100.0, on, off, violation_pct=pct)
        assert 0 <= lim.limit_tokens_per_s <= lim.offline_only_tokens_per_s
        assert lim.limit_tokens_per_s <= lim.kv_bound_tokens_per_s
        if lim.pacing_bound_tokens_per_s is not None:
            assert lim.limit_tokens_per_s <= lim.pacing_bound_tokens_per_s


def test_floor_never_exceeds_the_step_model() -> None:
    # The bound holds only if the floor is under every step the simulator can time.
    rng = random.Random(0)
    m = model_spec("qwen2.5-7b")
    base = RooflineParams.from_hardware(hardware_spec("a100-80gb"))
    calibrated = RooflineParams(
        **{k: getattr(base, k) for k in ("F_g", "F_ap", "F_ad", "M_g", "M_a", "O_p", "O_d")},
        B_c=base.B_c,
        O_k=5e-6,
        tile_tokens=64,
        knee=3.0,
        gemm_eff=((3584.0, 4608.0, ((1.0, 0.7), (4096.0, 1.3))),),
    )
    for params, tp in ((base, 1), (base, 2), (calibrated, 1)):
        model = RooflineModel(m, params, tp)
        f = linear_floor(model)
        for _ in range(300):
            p_reqs = rng.randint(0, 4)
            p_tok = sum(rng.randint(1, 2048) for _ in range(p_reqs))
            cached = rng.randint(0, 4000) if p_reqs else 0
            pairs = p_tok * (cached + p_tok)
            d = rng.randint(0 if p_reqs else 1, 512)
            ctx = sum(rng.randint(1, 8000) for _ in range(d))
            shape = BatchShape(p_tok, p_reqs, pairs, d, ctx)
            step = model.step_s(shape)
            for flops_side in (True, False):
                floor = f.step_floor_s(p_tok + d, p_reqs + d, p_tok, pairs, d, ctx, flops_side)
                assert floor <= step * (1 + 1e-12), (shape, floor, step)


def test_non_roofline_model_and_empty_mix_are_refused() -> None:
    with pytest.raises(ValueError, match="roofline"):
        offline_limit(object(), 1, 10, 100.0, [], [_req(RequestClass.OFFLINE, 0, 2, 3)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offline length mix is empty"):
        offline_limit(RooflineModel(TINY, TINY_PARAMS), 1, 10, 100.0, [], [])


def test_simulated_policies_stay_under_the_limit() -> None:
    # Two minutes of configs/ooco.yaml with offline offered well past saturation: no policy's
    # simulated offline tokens/s may pass the limit, and the best comes near it (not vacuous).
    cfg = load_config("configs/ooco.yaml", ("duration_s=120", "drain_s=0", "offline.rate=20"))
    # Each run is held to the limit at the violation rate it had (violating requests forgiven).
    shares = {}
    for pol in ("online-priority", "ooco", "tidal"):
        rec = simulate(cfg, pol)
        s = summarize(rec, cfg.duration_s, pol, cfg.name)
        lim = config_limit(cfg, pol, s["online"]["violation_pct"])
        shares[pol] = lim.share(s["offline"]["tokens_per_s"])
        assert 0 < shares[pol] <= 1, (pol, s["offline"], s["online"]["violation_pct"], lim)
        # the SLO pace forces steps, and the run took at least that many
        assert 0 < lim.paced_steps <= rec.num_steps, (pol, lim, rec.num_steps)
    assert max(shares.values()) >= 0.5, shares
