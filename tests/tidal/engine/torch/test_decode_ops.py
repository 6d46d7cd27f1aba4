"""The native decode kernels (`tidal/engine/torch/native/decode_ops.cpp`), each alone, against
the torch ops they replace (whole decodes through the engine: `test_fast_decode.py`)."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

from tidal.engine.torch import fast_decode, native

BF = torch.bfloat16
lib = native.load()
needs_native = pytest.mark.skipif(lib is None, reason="no C++ compiler to build the kernels")


def _p(t: torch.Tensor) -> int:
    return t.data_ptr()


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest gap in units of bf16 rounding of the reference's magnitude."""
    scale = ref.float().abs().clamp_min(1e-3) * 2**-8
    return float(((got.float() - ref.float()).abs() / scale).max())


@needs_native
def test_add_rms_norm_matches_torch() -> None:
    assert lib is not None
    g = torch.Generator().manual_seed(0)
    x, d = torch.randn(4, 576, generator=g).to(BF), torch.randn(4, 576, generator=g).to(BF)
    w = torch.rand(576, generator=g).to(BF)
    ref_x = x + d
    ref_h = F.rms_norm(ref_x, (576,), w, 1e-5)
    h = torch.empty_like(x)
    lib.tidal_add_rms_norm(_p(x), _p(d), _p(w), _p(h), 4, 576, 1e-5)
    assert torch.equal(x, ref_x)  # the residual add rounds as torch's does
    assert _ulps(h, ref_h) <= 1.0
    lib.tidal_add_rms_norm(_p(x), None, _p(w), _p(h), 4, 576, 1e-5)  # no residual: norm only
    assert torch.equal(x, ref_x) and _ulps(h, ref_h) <= 1.0


@needs_native
def test_rope_kv_write_and_attention_match_torch() -> None:
    assert lib is not None
    g = torch.Generator().manual_seed(1)
    H, Hk, D, T, slots_n, rows = 9, 3, 64, 37, 64, 3
    width = (H + 2 * Hk) * D
    qkv = torch.randn(rows, width, generator=g).to(BF)
    cos, sin = torch.randn(50, D, generator=g).to(BF), torch.randn(50, D, generator=g).to(BF)
    positions, slots = torch.tensor([7, 0, 49]), torch.tensor([20, 3, 63])
    kc = torch.randn(slots_n, Hk, D, generator=g).to(BF)
    vc = torch.randn(slots_n, Hk, D, generator=g).to(BF)
    qk = qkv[:, : (H + Hk) * D].view(rows, H + Hk, D)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    ref_qk = torch.addcmul(qk * c, qk.roll(D // 2, -1), s)  # llama.py's RoPE
    ref_v = qkv[:, (H + Hk) * D :].view(rows, Hk, D).clone()
    lib.tidal_rope_kv_write(
        _p(qkv), width, _p(cos), _p(sin), _p(positions), _p(kc), _p(vc), _p(slots), rows, H, Hk, D
    )
    assert _ulps(qkv[:, : (H + Hk) * D].view(rows, H + Hk, D), ref_qk) <= 1.0
    assert torch.equal(kc[slots], qkv[:, H * D : (H + Hk) * D].view(rows, Hk, D))
    assert torch.equal(vc[slots], ref_v)
    # one row's attention over slots [4, 4 + T) in place, and over a scattered slot list
    q = qkv[:1, : H * D].view(1, Hk, H // Hk, D)
    scores = torch.empty(8 * T)
    for ctx in (None, torch.randperm(slots_n, generator=g)[:T]):
        idx = torch.arange(4, 4 + T) if ctx is None else ctx
        k = kc.index_select(0, idx).transpose(0, 1).unsqueeze(0)
        v = vc.index_select(0, idx).transpose(0, 1).unsqueeze(0)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=D**-0.5)
        out = torch.empty(1, H * D, dtype=BF)
        sp = None if ctx is None else _p(ctx)
        lib.tidal_decode_attention(
            _p(qkv), _p(kc), _p(vc), sp, 4, T, H, Hk, D, D**-0.5, _p(scores), 1, _p(out)
        )
        torch.testing.assert_close(out.float().view(1, Hk, H // Hk, D), ref, atol=2e-2, rtol=0)


H, Hk, D = 9, 3, 64  # SmolLM2's heads: 9 query, 3 KV, 64 wide


def _rows_case(
    dt: torch.dtype, lens: torch.Tensor, slots_n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of decode rows for the row kernel: (qkv (B, width), k and v caches (slots_n, Hk,
    D), slots (B, max len): each row's context at random slots)."""
    g = torch.Generator().manual_seed(seed)
    B, Tmax = len(lens), int(lens.max())
    qkv = torch.randn(B, (H + 2 * Hk) * D, generator=g).to(dt)
    kc = torch.randn(slots_n, Hk, D, generator=g).to(dt)
    vc = torch.randn(slots_n, Hk, D, generator=g).to(dt)
    slots = torch.stack([torch.randperm(slots_n, generator=g)[:Tmax] for _ in range(B)])
    return qkv, kc, vc, slots


@needs_native
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_attention_rows_attend_each_row_over_its_own_context(dtype: str) -> None:
    # a batch of decode rows, contexts of different lengths (the slot table padded past each),
    # against SDPA row by row; fp32 (the `_f32io` kernel) to fp32 rounding
    assert lib is not None
    dt = getattr(torch, dtype)
    sfx = "" if dt == BF else "_f32io"
    lens = torch.tensor([1500, 1, 1200, 640])
    qkv, kc, vc, slots = _rows_case(dt, lens, slots_n=4000, seed=4)
    B, Tmax, width = len(lens), int(lens.max()), qkv.shape[1]
    for r, n in enumerate(lens.tolist()):
        slots[r, n:] = slots[r, 0]  # padding reads the row's own first slot, as the runner's
    out = torch.full((B, H * D), float("nan"), dtype=dt)
    scores = torch.empty(8 * Tmax)
    getattr(lib, "tidal_decode_attention_rows" + sfx)(
        _p(qkv), width, _p(kc), _p(vc), _p(slots), _p(lens), Tmax, B, H, Hk, D, D**-0.5,
        _p(scores), 1, _p(out),
    )  # fmt: skip
    tol = 2e-2 if dt == BF else 1e-5
    for r, n in enumerate(lens.tolist()):
        q = qkv[r : r + 1, : H * D].view(1, Hk, H // Hk, D).float()
        idx = slots[r, :n]
        k = kc.index_select(0, idx).transpose(0, 1).unsqueeze(0).float()
        v = vc.index_select(0, idx).transpose(0, 1).unsqueeze(0).float()
        ref = F.scaled_dot_product_attention(q, k, v, scale=D**-0.5)
        got = out[r].float().view(1, Hk, H // Hk, D)
        torch.testing.assert_close(got, ref, atol=tol, rtol=0)


@needs_native
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_attention_split_over_threads_gives_the_same_bits(dtype: str) -> None:
    # the (row, KV head) pairs split over the calling thread's team: any thread count, the
    # same output bits as one thread, for a batch and for a lone row in place
    assert lib is not None
    dt = getattr(torch, dtype)
    sfx = "" if dt == BF else "_f32io"
    lens = torch.tensor([700, 3, 1024, 256, 999])
    qkv, kc, vc, slots = _rows_case(dt, lens, slots_n=3000, seed=5)
    B, Tmax, width = len(lens), int(lens.max()), qkv.shape[1]
    was = torch.get_num_threads()
    outs, lone = [], []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)  # the calling thread's OpenMP team
            scores = torch.empty(threads * 8 * Tmax)
            out = torch.full((B, H * D), float("nan"), dtype=dt)
            getattr(lib, "tidal_decode_attention_rows" + sfx)(
                _p(qkv), width, _p(kc), _p(vc), _p(slots), _p(lens), Tmax, B, H, Hk, D,
                D**-0.5, _p(scores), threads, _p(out),
            )  # fmt: skip
            outs.append(out)
            one = torch.full((1, H * D), float("nan"), dtype=dt)
            getattr(lib, "tidal_decode_attention" + sfx)(
                _p(qkv), _p(kc), _p(vc), None, 7, 1500, H, Hk, D, D**-0.5, _p(scores), threads,
                _p(one),
            )  # fmt: skip
            lone.append(one)
    finally:
        torch.set_num_threads(was)
    assert not outs[0].isnan().any() and not lone[0].isnan().any()
    # the threads were real: the library was built with OpenMP (its runtime, in this process
    # torch's libgomp)
    assert "gomp" in subprocess.run(["ldd", lib._name], capture_output=True, text=True).stdout
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert all(torch.equal(o, lone[0]) for o in lone[1:])


@needs_native
def test_attention_at_the_longest_native_context_matches_sdpa() -> None:
    # SmolLM2's heads (9 query, 3 KV, 64 wide) over 8,192 tokens in place, as a long chat's
    assert lib is not None
    g = torch.Generator().manual_seed(3)
    H, Hk, D, T = 9, 3, 64, fast_decode.NATIVE_MAX_T
    qkv = torch.randn(1, (H + 2 * Hk) * D, generator=g).to(BF)
    kc = torch.randn(T + 5, Hk, D, generator=g).to(BF)
    vc = torch.randn(T + 5, Hk, D, generator=g).to(BF)
    out = torch.empty(1, H * D, dtype=BF)
    scores = torch.empty(8 * T)
    lib.tidal_decode_attention(
        _p(qkv), _p(kc), _p(vc), None, 5, T, H, Hk, D, D**-0.5, _p(scores), 1, _p(out)
    )
    q = qkv[:, : H * D].view(1, Hk, H // Hk, D).float()
    k, v = (c[5:].transpose(0, 1).unsqueeze(0).float() for c in (kc, vc))
    ref = F.scaled_dot_product_attention(q, k, v, scale=D**-0.5)
    torch.testing.assert_close(out.float().view(1, Hk, H // Hk, D), ref, atol=2e-2, rtol=0)


@needs_native
def test_silu_mul_matches_torch() -> None:
    assert lib is not None
    gu = torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(BF) * 4
    g, u = gu.chunk(2, dim=-1)
    out = torch.empty(3, 1536, dtype=BF)
    lib.tidal_silu_mul(_p(gu), _p(out), 3, 1536)
    assert _ulps(out, F.silu(g) * u) <= 1.0
