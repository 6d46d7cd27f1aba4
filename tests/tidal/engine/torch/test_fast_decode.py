"""Decode steps on native kernels (`tidal.engine.torch.fast_decode`) against the torch
ops they replace: each kernel alone, then whole decodes through the engine, both paths side by
side."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.tidal.engine.torch.test_llama import greedy, prompt
from tidal.engine.api import EngineRequest
from tidal.engine.torch import attention, fast_decode, native
from tidal.engine.torch.attention import AttnMeta
from tidal.engine.torch.engine import TorchEngine

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


def _decode(engine: TorchEngine, rid: str, p: list[int], steps: int) -> tuple[list[int], list[Any]]:
    engine.add(EngineRequest(rid, p, greedy(steps)))
    engine.runner.keep_logits = True
    toks, logits = [], []
    while engine.has_work():
        engine.runner.last_logits = {}
        for ev in engine.step().events:
            toks += ev.token_ids
            logits.append(engine.runner.last_logits[rid])
    return toks, logits


@needs_native
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3-rope"])
@pytest.mark.parametrize("context", ["span", "slots", "long"])
def test_native_decode_decode_matches_the_torch_path(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch, arch: str, context: str, dtype: str
) -> None:
    engine = make_engine(arch, dtype=dtype, chunk_size=7, token_budget=16)
    model = engine.model
    assert model.native_decode is not None
    if context == "long":  # contexts past the kernel's limit go to torch's SDPA
        monkeypatch.setattr(fast_decode, "NATIVE_MAX_T", 8)
    if context == "slots":  # another request's blocks between this one's: no in-place span
        monkeypatch.setattr("tidal.engine.torch.runner._span", lambda seq, bs: None)
    ran: list[int] = []
    real = fast_decode.NativeDecode.run

    def spy(self: Any, batch: Any, *a: Any) -> int:
        ran.append(len(batch.groups[0][2].prefills))
        return real(self, batch, *a)

    monkeypatch.setattr(fast_decode.NativeDecode, "run", spy)
    p = prompt(30, 5)
    toks, logits = _decode(engine, "native", p, 12)
    assert ran == [1] * 5 + [0] * 11  # the prompt's 5 chunks, then every decode step
    native_decode, model.native_decode = model.native_decode, None
    ref_toks, ref_logits = _decode(engine, "torch", p, 12)
    model.native_decode = native_decode
    assert toks == ref_toks
    for lg, ref in zip(logits, ref_logits, strict=True):
        assert (lg - ref).abs().max() <= 0.02 * ref.abs().max() + 0.02


@needs_native
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batched_decodes_match_the_torch_path(make_engine: Any, dtype: str) -> None:
    # contexts of three lengths decoded together: the native attention row by row (no gather)
    engine = make_engine("qwen2", dtype=dtype)
    model = engine.model
    prompts = {"a": prompt(20, 7), "b": prompt(9, 8), "c": prompt(14, 9)}

    def run(tag: str) -> dict[str, list[int]]:
        toks: dict[str, list[int]] = {r: [] for r in prompts}
        for rid, p in prompts.items():
            engine.add(EngineRequest(tag + rid, p, greedy(10)))
        while engine.has_work():
            for ev in engine.step().events:
                toks[ev.req_id[len(tag) :]] += ev.token_ids
        return toks

    steps: list[int] = []
    real = fast_decode.NativeDecode.run

    def spy(self: Any, batch: Any, *a: Any) -> int:
        steps.append(batch.hidden.shape[0])
        return real(self, batch, *a)

    torch_decodes: list[int] = []
    real_attention = attention.ATTENTION

    def attention_spy(q: Any, k: Any, v: Any, meta: Any, scale: float) -> Any:
        if not meta.prefills:
            torch_decodes.append(q.shape[0])
        return real_attention(q, k, v, meta, scale)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_decode.NativeDecode, "run", spy)
        mp.setattr(attention, "ATTENTION", attention_spy)
        mp.setattr(fast_decode, "ROW_ATTENTION", True)
        got = run("n-")
    assert 3 in steps  # the three decoded together on the native path
    assert torch_decodes == []  # with the native attention, row by row
    if dtype == "float32":  # the same tokens: both paths compute in fp32
        native_decode, model.native_decode = model.native_decode, None
        assert got == run("t-")
        model.native_decode = native_decode
        return
    # bf16: the kernel rounds once where the torch path's batched matmuls round scores and
    # probabilities to bf16 too, so a greedy decode of random weights may part ways; one step of
    # the three rows on both paths gives the same values to bf16 rounding over the layers
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, greedy(10)))
    while any(not s.is_decode for s in engine.seqs.values()):
        engine.step()
    items = [(engine.seqs[r], 1) for r in prompts]
    outs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_decode, "ROW_ATTENTION", True)
        for native_decode in (model.native_decode, None):
            model.native_decode = native_decode
            batch, _ = engine.runner._build(items, [0] * len(items))
            model.forward_layers(batch, engine.runner.kv, None)
            outs.append(batch.hidden.float())
    gap = (outs[0] - outs[1]).abs().amax(dim=1)
    assert bool((gap <= 0.02 * outs[1].abs().amax(dim=1)).all()), gap


def _interleaved(engine: TorchEngine, late: int) -> dict[str, list[Any]]:
    """Three requests on one prompt, "c" arriving `late` steps after "a" and "b" (0: together);
    the logits each token was sampled from. "c" asks for one token fewer, so no row decodes
    alone when it comes a step late (a one-row step's GEMV rounds otherwise than a batch's
    GEMM, as it must to stay fast)."""
    p = prompt(21, 31)
    engine.runner.keep_logits = True
    logits: dict[str, list[Any]] = {r: [] for r in "abc"}
    for rid in "ab":
        engine.add(EngineRequest(rid, p, greedy(8)))
    step = 0
    while engine.has_work():
        if step == late:
            engine.add(EngineRequest("c", p, greedy(7)))
        engine.runner.last_logits = {}
        for ev in engine.step().events:
            logits[ev.req_id].append(engine.runner.last_logits[ev.req_id])
        step += 1
    return logits


@needs_native
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_decode_beside_a_prefill_rounds_as_among_decodes_alone(
    make_engine: Any, dtype: str
) -> None:
    # test_n's seeded request sent twice: whether a choice's prefill shares a step with the
    # others' decodes depends on when it arrived. A decode row must compute the same bits either
    # way: on the torch path its attention rounded scores and probabilities to bf16 where the
    # native kernel rounds once, and its norms and RoPE differed from the kernels' in the last
    # bit now and then, so sampled tokens parted ways
    assert fast_decode.ROW_ATTENTION
    ref = _interleaved(make_engine("qwen2", dtype=dtype, enable_prefix_cache=False), 0)
    got = _interleaved(make_engine("qwen2", dtype=dtype, enable_prefix_cache=False), 1)
    for rid in "abc":
        assert len(got[rid]) == len(ref[rid]) == (7 if rid == "c" else 8)
        for j, (a, b) in enumerate(zip(got[rid], ref[rid], strict=True)):
            assert torch.equal(a, b), (rid, j, (a - b).abs().max())


@needs_native
def test_a_preempted_step_stops_at_the_same_layer(make_engine: Any) -> None:
    engine = make_engine("llama", dtype="bfloat16")
    model, runner = engine.model, engine.runner
    engine.add(EngineRequest("a", prompt(20, 6), greedy(4)))
    engine.step()  # prefill; "a" now decodes
    seq = engine.seqs["a"]
    outs = []
    for native_decode in (model.native_decode, None):
        model.native_decode = native_decode
        batch, _ = runner._build([(seq, 1)], [0])
        calls = iter(range(100))
        layers = model.forward_layers(batch, runner.kv, lambda c=calls: next(c) == 1)
        assert layers == 2  # stopped at the boundary after the second layer
        outs.append(batch.hidden.clone())
    # the same values to bf16 rounding, compounded over two layers
    assert (outs[0].float() - outs[1].float()).abs().max() <= 0.02 * outs[1].float().abs().max()


def test_kernels_off_or_unbuildable_leave_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        native.build("false", tmp_path)  # a compiler that fails
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    monkeypatch.setenv("TIDAL_NATIVE", "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()
    monkeypatch.setenv("TIDAL_NATIVE", "1")
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ or c++ anywhere
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(12, 1, 16), (4, 2, 24)],
    ids=["12-query-heads-a-kv-head", "head-of-24"],
)
def test_heads_past_the_kernels_buffers_stay_on_the_torch_attention(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    # 12 query heads over one KV head (past the kernels' 8), or heads of 24 (the kernels' dot
    # products take a head in whole vectors of 16 floats): the model keeps its native path for
    # what fits it, but a decode's attention is torch's, the same values, nothing written out
    # of bounds
    from tidal.engine.torch.model_config import ModelConfig
    from tidal_bench.engine.measure import random_engine

    cfg = ModelConfig(
        model_type="llama", vocab_size=300, hidden_size=heads * head_dim, intermediate_size=256,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=256,
    )  # fmt: skip
    model = random_engine(cfg, torch.device("cpu"), BF).model
    nd = model.native_decode
    assert nd is not None and not nd.shapes_fit
    g = torch.Generator().manual_seed(7)
    T = 40
    q = torch.randn(1, heads, head_dim, generator=g).to(BF)
    kc, vc = (torch.randn(T, kv_heads, head_dim, generator=g).to(BF) for _ in range(2))
    meta = AttnMeta(decode_rows=slice(0, 1), decode_slots=None, decode_bias=None)
    meta.decode_span = (0, T)
    got = nd.attention(q, kc, vc, meta, 0.25)
    torch.testing.assert_close(got, attention.ATTENTION(q, kc, vc, meta, 0.25), atol=0, rtol=0)
