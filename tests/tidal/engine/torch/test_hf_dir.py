"""A local Hugging Face directory (Llama, Qwen2, Mistral) loads into the torch engine and gives
the logits `transformers` gives on the same files: the prompt's prefill and each decode step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tidal.engine.hf_dir import write_hf_dir
from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch.loader import load_torch_engine
from tidal.engine.torch.model_config import ModelConfig

TOLERANCE = 1e-4  # fp32 on both sides: different kernels, same math


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_hf_directory_logits_match_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    d = write_hf_dir(tmp_path / f"tiny-{arch}", arch, seed=len(arch))
    engine = load_torch_engine(str(d), dtype="float32", kv_cache_tokens=1024, block_size=8)
    assert engine.model_name == f"tiny-{arch}"
    engine.runner.keep_logits = True
    prompt = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    engine.add(
        EngineRequest("r", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    )
    tokens: list[int] = []
    ours: list[torch.Tensor] = []
    while engine.has_work():
        engine.runner.last_logits = {}
        for ev in engine.step().events:
            tokens += ev.token_ids
            ours.append(engine.runner.last_logits[ev.req_id].float())
    assert len(tokens) == 5
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0]  # (T, V)
    # The logits each token was sampled from: position len(prompt) - 1 + j.
    diffs = [(lg - ref[len(prompt) - 1 + j]).abs().max().item() for j, lg in enumerate(ours)]
    print(f"{arch}: max |logit - HF logit| = {max(diffs):.2e}")
    assert max(diffs) < TOLERANCE, diffs
    assert tokens == [int(ref[len(prompt) - 1 + j].argmax()) for j in range(5)]


def test_sliding_window_caps_the_context() -> None:
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1)
    base |= dict(num_attention_heads=2, max_position_embeddings=32768)
    assert (
        ModelConfig.from_hf_dict(
            {**base, "model_type": "mistral", "sliding_window": 4096}
        ).sliding_window
        == 4096
    )
    assert (
        ModelConfig.from_hf_dict(
            {**base, "model_type": "mistral", "sliding_window": None}
        ).sliding_window
        == 0
    )
    qwen = {**base, "model_type": "qwen2", "sliding_window": 4096}
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": False}).sliding_window == 0
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True}).sliding_window == 4096
