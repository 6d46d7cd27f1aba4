"""Decode steps on native kernels (`tidal.engine.torch.fast_decode`) against the torch
ops they replace: whole decodes through the engine, both paths side by side (each kernel alone:
`test_decode_ops.py`)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tidal.engine.torch.test_llama import greedy, prompt
from tidal.engine.api import EngineRequest
from tidal.engine.torch import attention, fast_decode, native
from tidal.engine.torch.attention import AttnMeta
from tidal.engine.torch.engine import TorchEngine

BF = torch.bfloat16
lib = native.load()
needs_native = pytest.mark.skipif(lib is None, reason="no C++ compiler to build the kernels")


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
