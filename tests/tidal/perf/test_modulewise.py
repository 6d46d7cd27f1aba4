from __future__ import annotations

import numpy as np
import pytest

from tidal.perf.api import BatchShape
from tidal.perf.modulewise import (
    ModuleWiseModel,
    build_dense_table,
    causal_prefill_load,
    fit_modulewise_steps,
    modulewise_from_dict,
    modulewise_to_dict,
)


def test_causal_prefill_load_hand_worked() -> None:
    # chunk of q=4 after l=2 cached: Σ_{i=3}^{6} i = 18; pairs = 4·6 = 24, Σq² = 16:
    # 24 - 16/2 + 4/2 = 18
    b = BatchShape(num_prefill_tokens=4, num_prefill_reqs=1, prefill_attn_pairs=24,
                   prefill_sq_tokens=16)  # fmt: skip
    assert causal_prefill_load(b) == 18
    # unknown squares: equal chunks assumed (two chunks of 4 from empty caches: 2·10 = 20)
    b2 = BatchShape(num_prefill_tokens=8, num_prefill_reqs=2, prefill_attn_pairs=32)
    assert causal_prefill_load(b2) == 20


def test_step_hand_worked() -> None:
    m = ModuleWiseModel(
        num_layers=2, a_pa=0.001, b_pa=0.1, a_da=0.01, h_da=0.5, b_da=0.2,
        dense=((1.0, 1.0), (11.0, 2.0)), gamma_alpha=0.05, gamma_beta=0.01, step_overhead_s=3.0,
    )  # fmt: skip
    b = BatchShape(num_prefill_tokens=4, num_prefill_reqs=1, prefill_attn_pairs=24,
                   prefill_sq_tokens=16, num_decode_reqs=2, decode_context_tokens=10)  # fmt: skip
    # n = 6: f_D = 1 + (6-1)/10 = 1.5; γ = .05 + .01·6 = .11; f_PA = .001·18 + .1 = .118;
    # f_DA = .01·(10+2) + .5·2 + .2 = 1.32; per layer 3.048 · 2 layers + 3 = 9.096
    assert m.step_s(b) == pytest.approx(9.096)


def test_alg1_finds_the_steps_with_few_probes() -> None:
    # a staircase: +1 every 128 tokens on a gentle slope, the shape of Fig. 8c
    probes: list[int] = []

    def lat(n: int) -> float:
        probes.append(n)
        return 10.0 + (n - 1) // 128 + 0.001 * n

    table = build_dense_table(lat, 1, 4096)
    m = ModuleWiseModel(1, 0, 0, 0, 0, 0, table)
    errs = [abs(m.f_d(n) / lat(n) - 1) for n in range(1, 4097, 7)]
    assert np.mean(errs) < 0.01
    assert len(table) < 4096 / 4  # far fewer probes than sizes


def test_alg1_flat_function_needs_only_the_ends() -> None:
    table = build_dense_table(lambda n: 5.0 + 1e-6 * n, 1, 4096)
    assert [k[0] for k in table] == [1, 16, 4096]


def test_fit_recovers_known_parameters_from_steps() -> None:
    rng = np.random.default_rng(0)
    knots = np.array([1.0, 64, 128, 256, 512])  # past 512: both extrapolate the last segment
    dense = tuple((float(k), 1e-4 + 2e-7 * k) for k in knots)
    true = ModuleWiseModel(4, 2e-10, 3e-5, 4e-9, 2e-7, 5e-5, dense)
    batches = []
    for _ in range(600):
        sp = int(rng.integers(0, 800)) if rng.random() < 0.7 else 0
        nd = int(rng.integers(1, 200)) if (rng.random() < 0.7 or sp == 0) else 0
        chunk_sq = sp * sp
        batches.append(BatchShape(sp, 1 if sp else 0, sp * (sp + int(rng.integers(0, 2000))), nd,
                                  nd * int(rng.integers(100, 3000)), chunk_sq))  # fmt: skip
    y = np.array([true.step_s(b) for b in batches])
    fit = fit_modulewise_steps(batches, y, 4, knots=knots, ridge=0.0)
    assert (fit.a_pa, fit.b_pa, fit.a_da, fit.h_da, fit.b_da) == pytest.approx(
        (true.a_pa, true.b_pa, true.a_da, true.h_da, true.b_da), rel=1e-4
    )
    assert [k[1] for k in fit.dense] == pytest.approx([k[1] for k in dense], rel=1e-4)


def test_dict_round_trip() -> None:
    m = ModuleWiseModel(3, 1e-9, 1e-5, 1e-9, 1e-7, 1e-5, ((1.0, 1e-4), (64.0, 2e-4)))
    assert modulewise_from_dict(modulewise_to_dict(m)) == m
