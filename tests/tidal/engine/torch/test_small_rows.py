"""An fp32 model whose small-row matmuls run on bf16 weight copies (`small_rows`): the native
fp32 kernels against torch's ops, whole decodes against the plain fp32 model (and the bf16 one
as the yardstick of a bf16 rounding), the row bound, and SmolLM2's greedy answer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.tidal.engine.torch.test_llama import prompt, run_collect_logits
from tidal.engine.torch import fast_decode, native
from tidal.engine.torch.engine import TorchEngine

BF = torch.bfloat16
lib = native.load()
needs_native = pytest.mark.skipif(lib is None, reason="no C++ compiler to build the kernels")


def _p(t: torch.Tensor) -> int:
    return t.data_ptr()


@needs_native
def test_f32_norm_rope_and_attention_kernels_match_torch() -> None:
    assert lib is not None
    g = torch.Generator().manual_seed(0)
    x, d = torch.randn(3, 576, generator=g), torch.randn(3, 576, generator=g).to(BF)
    w = torch.rand(576, generator=g)
    ref_x = x + d.float()
    ref_h = F.rms_norm(ref_x, (576,), w, 1e-5).to(BF)  # fp32 norm, rounded as the matmul's input
    h = torch.empty(3, 576, dtype=BF)
    lib.tidal_add_rms_norm_f32(_p(x), _p(d), _p(w), _p(h), 3, 576, 1e-5)
    assert torch.equal(x, ref_x)  # the fp32 residual is not rounded
    torch.testing.assert_close(h.float(), ref_h.float(), atol=0, rtol=2**-7)
    # RoPE on the bf16 qkv with fp32 tables; k and v land in the fp32 cache
    H, Hk, D, rows, n_slots = 9, 3, 64, 2, 16
    width = (H + 2 * Hk) * D
    qkv = torch.randn(rows, width, generator=g).to(BF)
    cos, sin = torch.randn(40, D, generator=g), torch.randn(40, D, generator=g)
    positions, slots = torch.tensor([5, 39]), torch.tensor([2, 11])
    kc, vc = torch.zeros(n_slots, Hk, D), torch.zeros(n_slots, Hk, D)
    qk = qkv[:, : (H + Hk) * D].float().view(rows, H + Hk, D)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    ref_qk = torch.addcmul(qk * c, qk.roll(D // 2, -1), s)  # llama.py's RoPE, in fp32
    ref_v = qkv[:, (H + Hk) * D :].float().view(rows, Hk, D)
    lib.tidal_rope_kv_write_f32(
        _p(qkv), width, _p(cos), _p(sin), _p(positions), _p(kc), _p(vc), _p(slots), rows, H, Hk, D
    )
    torch.testing.assert_close(kc[slots], ref_qk[:, H:], atol=1e-5, rtol=1e-5)
    assert torch.equal(vc[slots], ref_v)
    got_q = qkv[:, : H * D].float().view(rows, H, D)
    torch.testing.assert_close(got_q, ref_qk[:, :H], atol=1e-5, rtol=2**-8)  # q rounded to bf16
    # one row's attention over the fp32 cache's slots [1, 1 + T)
    T = n_slots - 1
    kc, vc = torch.randn(n_slots, Hk, D, generator=g), torch.randn(n_slots, Hk, D, generator=g)
    q = qkv[:1, : H * D].view(1, Hk, H // Hk, D).float()
    k, v = (cc[1:].transpose(0, 1).unsqueeze(0) for cc in (kc, vc))
    ref = F.scaled_dot_product_attention(q, k, v, scale=D**-0.5)
    out, scores = torch.empty(1, H * D, dtype=BF), torch.empty(8 * T)
    lib.tidal_decode_attention_f32(
        _p(qkv), _p(kc), _p(vc), None, 1, T, H, Hk, D, D**-0.5, _p(scores), 1, _p(out)
    )
    torch.testing.assert_close(out.float().view(1, Hk, H // Hk, D), ref, atol=1e-2, rtol=0)


def _engine(make_engine: Any, arch: str, rows: int, dtype: str = "float32") -> TorchEngine:
    return make_engine(arch, dtype=dtype, bf16_weight_rows=rows, chunk_size=7, token_budget=32)


PROMPTS = {"a": prompt(20, 1), "b": prompt(9, 2), "c": prompt(14, 3)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_small_row_logits_stay_within_a_bf16_rounding_of_fp32(make_engine: Any, arch: str) -> None:
    """Three requests decoding together (3 rows, under the bound of 8) on the bf16 copies: their
    logits differ from the plain fp32 model's by no more than the bf16 model's do (plus a
    margin), and the native and torch paths of the split model agree."""
    mixed = _engine(make_engine, arch, 8)
    assert mixed.model.small is not None and mixed.model.dtype == torch.float32
    assert mixed.model.native_decode is not None or lib is None
    _, got = run_collect_logits(mixed, PROMPTS, 8)
    _, ref = run_collect_logits(_engine(make_engine, arch, 0), PROMPTS, 8)
    _, bf16 = run_collect_logits(_engine(make_engine, arch, 0, "bfloat16"), PROMPTS, 8)
    for r in PROMPTS:
        for lg, fp, bf in zip(got[r], ref[r], bf16[r], strict=True):
            bf16_gap = float((bf - fp).abs().max())
            assert float((lg - fp).abs().max()) <= 1.5 * bf16_gap + 1e-3
    if mixed.model.native_decode is not None:
        mixed.model.native_decode = None  # the same split model on torch's ops
        _, torch_ops = run_collect_logits(mixed, PROMPTS, 8)
        for r in PROMPTS:
            for lg, tp in zip(got[r], torch_ops[r], strict=True):
                assert (lg - tp).abs().max() <= 0.02 * tp.abs().max() + 0.02


def test_rows_past_the_bound_run_on_fp32_weights(make_engine: Any) -> None:
    engine = _engine(make_engine, "llama", 2)
    model = engine.model
    small = model.small
    assert small is not None and small.applies(2) and not small.applies(3)
    # one-row steps read half the matrix bytes; three-row ones the fp32 weights
    assert model.weight_bytes(rows=1) < 0.6 * model.weight_bytes(rows=3)
    assert model.weight_bytes(rows=3) == model.weight_bytes()
    steps: list[int] = []
    real = fast_decode.NativeDecode.run

    def spy(self: Any, batch: Any, *a: Any) -> int:
        steps.append(batch.hidden.shape[0])
        return real(self, batch, *a)

    copies: list[int] = []  # rows of each matmul on the bf16 copies
    real_linear, real_mm = type(small).linear, fast_decode.NativeDecode._mm

    def linear_spy(self: Any, x: Any, *a: Any, **kw: Any) -> Any:
        copies.append(x.shape[0])
        return real_linear(self, x, *a, **kw)

    def mm_spy(self: Any, x: Any, w: Any, out: Any, b: Any, split: bool, mat: Any = None) -> Any:
        if mat is not None:  # the native GEMV on a copy (`_gemv_table`), not through `linear`
            assert split
            copies.append(x.shape[0])
        return real_mm(self, x, w, out, b, split, mat)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_decode.NativeDecode, "run", spy)
        mp.setattr(fast_decode.NativeDecode, "_mm", mm_spy)
        mp.setattr(type(small), "linear", linear_spy)
        toks, _ = run_collect_logits(engine, PROMPTS, 6)
    # 3-row decode steps ran natively too, on the fp32 weights (`_f32io` kernels)
    assert 3 in steps and copies and max(copies) <= 2
    assert toks == run_collect_logits(_engine(make_engine, "llama", 0), PROMPTS, 6)[0]


def test_only_an_fp32_cpu_model_takes_copies(make_engine: Any) -> None:
    bf = _engine(make_engine, "llama", 8, "bfloat16")
    assert bf.model.small is None and not bf.model.use_bf16_weights(8)
    fp = _engine(make_engine, "llama", 0)
    assert fp.model.small is None and not fp.model.use_bf16_weights(0)


@pytest.mark.slow
def test_smollm2_split_answers_as_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.engine.torch.loader import load_torch_engine

    def answer(rows: int) -> tuple[str, list[torch.Tensor]]:
        engine: Any = load_torch_engine(dtype="float32", bf16_weight_rows=rows)
        tok = engine.tokenizer
        text = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        toks, logits = run_collect_logits(engine, {"q": tok.encode(text)}, 12)
        return tok.decode(toks["q"]), logits["q"]

    split, split_logits = answer(8)
    plain, plain_logits = answer(0)
    assert "Paris" in plain and split == plain
    for lg, ref in zip(split_logits, plain_logits, strict=True):
        assert (lg - ref).abs().max() <= 0.03 * ref.abs().max()


def test_the_env_sets_the_rows_over_the_choice(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_DTYPE", "float32")  # chosen by the env, not measured
    monkeypatch.setenv("TIDAL_BF16_WEIGHT_ROWS", "4")
    small = make_engine("llama", dtype=None).model.small
    assert small is not None and small.max_rows == 4
    assert make_engine("llama").model.small is None  # an explicit dtype: explicit rows only
    monkeypatch.setenv("TIDAL_BF16_WEIGHT_ROWS", "0")
    assert make_engine("llama", dtype=None).model.small is None
