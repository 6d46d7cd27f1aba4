"""The torch engine's forward pass against HF `transformers` on tiny random checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch.engine import TorchEngine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def run_collect_logits(
    engine: TorchEngine, prompts: dict[str, list[int]], max_tokens: int
) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Run to completion; returns output tokens and the logits each token was sampled from."""
    engine.runner.keep_logits = True
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, greedy(max_tokens)))
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}
    while engine.has_work():
        engine.runner.last_logits = {}
        res = engine.step()
        for ev in res.events:
            tokens[ev.req_id] += ev.token_ids
            logits[ev.req_id].append(engine.runner.last_logits[ev.req_id])
        engine.check_integrity()
    return tokens, logits


def hf_all_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (T, V)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3-rope"])
@pytest.mark.parametrize("chunk_size", [512, 7])
def test_logits_match_hf_prefill_chunked_and_decode(
    make_engine: Any, hf_models: dict[str, Any], arch: str, chunk_size: int
) -> None:
    # Three requests of different lengths share steps: with chunk 7 a step mixes prefill
    # chunks and decodes; with 512 each prompt is one full prefill.
    prompts = {"a": prompt(23, 1), "b": prompt(5, 2), "c": prompt(90, 3)}
    engine = make_engine(arch, chunk_size=chunk_size, token_budget=max(chunk_size, 16))
    tokens, logits = run_collect_logits(engine, prompts, max_tokens=6)
    for rid, p in prompts.items():
        assert len(tokens[rid]) == 6
        ref = hf_all_logits(hf_models[arch], p + tokens[rid])
        for j, lg in enumerate(logits[rid]):
            torch.testing.assert_close(lg, ref[len(p) - 1 + j], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_hf_generate(make_engine: Any, hf_models: dict[str, Any], arch: str) -> None:
    prompts = {"x": prompt(17, 4), "y": prompt(40, 5)}
    engine = make_engine(arch, chunk_size=16, token_budget=32)
    tokens, _ = run_collect_logits(engine, prompts, max_tokens=12)
    for rid, p in prompts.items():
        with torch.no_grad():
            out = hf_models[arch].generate(
                torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0
            )
        assert tokens[rid] == out[0, len(p) :].tolist()
