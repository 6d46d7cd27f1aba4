"""Each single-row decode path of the torch engine against HF `transformers`: in place over
consecutive blocks, gathered + SDPA, gathered + matmuls past `SDPA_MAX_SINGLE_T`; and the
reduced-precision GEMV path (bf16) against oneDNN's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.tidal.engine.torch.test_llama import greedy, hf_all_logits, prompt
from tidal.engine.api import EngineRequest
from tidal.engine.torch import attention, cpu_caps, llama, packed
from tidal.engine.torch.engine import TorchEngine


def lone_decode_logits(engine: TorchEngine, rid: str, steps: int) -> tuple[list[int], list[Any]]:
    """Decode `rid` alone for `steps` steps; tokens and the logits each was sampled from."""
    engine.runner.keep_logits = True
    toks, logits = [], []
    for _ in range(steps):
        engine.runner.last_logits = {}
        for ev in engine.step().events:
            assert ev.req_id == rid
            toks += ev.token_ids
            logits.append(engine.runner.last_logits[rid])
    return toks, logits


@pytest.mark.parametrize("path", ["span", "gather-sdpa", "gather-matmul"])
def test_lone_decode_paths_match_hf(
    make_engine: Any,
    hf_models: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    engine = make_engine("llama", chunk_size=7, token_budget=16)
    engine.model.native_decode = (
        None  # the torch path's attention (the native one: test_fast_decode)
    )
    p = prompt(30, 11)
    engine.add(EngineRequest("a", p, greedy(8)))
    if path != "span":
        # a second request prefilled beside the first interleaves their blocks, then leaves
        engine.add(EngineRequest("b", prompt(30, 12), greedy(8)))
    toks: list[int] = []
    while not toks:  # prefill until the prompt's last chunk gives the first token
        toks += [t for ev in engine.step().events if ev.req_id == "a" for t in ev.token_ids]
    engine.abort("b")
    if path == "gather-matmul":
        monkeypatch.setattr(attention, "SDPA_MAX_SINGLE_T", 4)
    seen: list[str] = []
    real = attention.sdpa_paged_attention

    def spy(q: Any, k: Any, v: Any, meta: Any, scale: float) -> Any:
        seen.append("span" if meta.decode_span is not None else "gather")
        return real(q, k, v, meta, scale)

    monkeypatch.setattr(attention, "ATTENTION", spy)
    more, logits = lone_decode_logits(engine, "a", 6)
    assert set(seen) == {"span" if path == "span" else "gather"}
    ref = hf_all_logits(hf_models["llama"], p + toks + more)
    for j, lg in enumerate(logits):
        torch.testing.assert_close(lg, ref[len(p) + j], atol=1e-4, rtol=0)


def test_bf16_gemv_matches_onednn() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 576, generator=g).bfloat16()
    w = torch.randn(1536, 576, generator=g).bfloat16()
    b = torch.randn(1536, generator=g).bfloat16()
    assert torch._C._get_mkldnn_enabled()
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    got = packed.gemv_native(x, w, b)
    assert torch._C._get_mkldnn_enabled()  # restored
    torch.testing.assert_close(got.float(), ref, atol=0.25, rtol=1e-2)
    into = torch.empty(1, 1536, dtype=torch.bfloat16)  # the native decode path's form
    assert packed.gemv_native(x, w, b, out=into) is into and torch.equal(into, got)
    assert torch._C._get_mkldnn_enabled()
    onednn = torch.nn.functional.linear(x, w, b).float()
    # both accumulate in fp32: the gap to oneDNN is within bf16 rounding of the output
    assert (got.float() - onednn).abs().max() <= 2 * onednn.abs().max() * 2**-8


def test_bf16_engine_tracks_hf(make_engine: Any, hf_models: dict[str, Any]) -> None:
    # batch 1 runs the native GEMV and the in-place SDPA path in bf16; batch 2 runs oneDNN
    engine = make_engine("llama", dtype="bfloat16")
    assert engine.model.gemv_native and not engine.model.transposed
    prompts = {"a": prompt(20, 21), "b": prompt(9, 22)}
    for rid, p in prompts.items():  # "a" decodes beside "b", then alone
        engine.add(EngineRequest(rid, p, greedy(6 if rid == "a" else 2)))
    engine.runner.keep_logits = True
    got: dict[str, list[Any]] = {r: [] for r in prompts}
    toks: dict[str, list[int]] = {r: [] for r in prompts}
    while engine.has_work():
        engine.runner.last_logits = {}
        for ev in engine.step().events:
            toks[ev.req_id] += ev.token_ids
            got[ev.req_id].append(engine.runner.last_logits[ev.req_id])
    for rid, p in prompts.items():
        ref = hf_all_logits(hf_models["llama"], p + toks[rid])
        for j, lg in enumerate(got[rid]):
            row = ref[len(p) - 1 + j]
            assert (lg - row).abs().max() <= 0.05 * row.abs().max() + 0.05


def test_bf16_packed_matmul_is_exact() -> None:
    # multi-row bf16 matmuls run on oneDNN-packed weights: the same numbers as F.linear
    if why := cpu_caps.pack_refusal(torch.bfloat16):
        pytest.skip(f"oneDNN bf16 packing unavailable on this CPU: {why}")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(960, 576, generator=g).bfloat16()
    b = torch.randn(960, generator=g).bfloat16()
    pw = packed.pack(w)
    for rows in (2, 5, 32, 33):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        got = llama.linear(x, w, b, False, True, pw)
        assert torch.equal(got, torch.nn.functional.linear(x, w, b))


def test_engine_packs_its_weights_where_onednn_takes_the_dtype(make_engine: Any) -> None:
    bf = make_engine("llama", dtype="bfloat16").model
    n_mats = 4 * bf.config.num_hidden_layers + 1  # qkv, o, gate_up, down a layer; LM head
    if cpu_caps.pack_refusal(torch.bfloat16):  # the fallback: plain weights, F.linear
        assert bf.packed_w == {} and not cpu_caps.can_pack(bf.device, torch.bfloat16)
    else:
        assert len(bf.packed_w) == n_mats
        assert id(bf.layers[0].gate_up) in bf.packed_w and id(bf.lm_head) in bf.packed_w
    # fp32 packs on AVX2 too; its (in, out) matrices are packed from their transpose
    fp = make_engine("llama", dtype="float32").model
    assert fp.transposed and cpu_caps.can_pack(fp.device, torch.float32)
    assert len(fp.packed_w) == n_mats
    w = fp.layers[0].gate_up  # (in, out)
    x = torch.randn(5, w.shape[0], generator=torch.Generator().manual_seed(2))
    got = llama.linear(x, w, None, True, False, fp.packed_w[id(w)])
    torch.testing.assert_close(got, x @ w, rtol=1e-5, atol=1e-5)
    assert torch.equal(llama.linear(x[:1], w, None, True, False, fp.packed_w[id(w)]), x[:1] @ w)
