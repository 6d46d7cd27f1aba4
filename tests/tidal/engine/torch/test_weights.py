"""Model loading: errors name the path; the embedded SmolLM2 GGUF answers a chat question."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch.loader import load_torch_engine
from tidal.engine.torch.model_config import ModelConfig
from tidal.engine.torch.weights import ModelLoadError, embedded_model_path


def test_missing_and_corrupt_models_give_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match=r"nope\.gguf") as e:
        load_torch_engine(str(missing))
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf") as e:
        load_torch_engine(str(bad))
    assert "\n" not in str(e.value)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ModelLoadError, match="empty"):
        load_torch_engine(str(empty_dir))


def test_config_parses_transformers_4_and_5_rope_fields() -> None:
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        model_type="qwen2",
    )
    old = ModelConfig.from_hf_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = ModelConfig.from_hf_dict(
        {**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
    )
    assert old.rope_theta == new.rope_theta == 5e5 and old.rope_type == new.rope_type == "linear"
    assert new.attention_bias and new.num_key_value_heads == 2 and new.head_dim == 4
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "longrope"}})


def test_embedded_model_is_located_without_importing_its_package() -> None:
    p = embedded_model_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.exists()


@pytest.mark.slow
def test_smollm2_answers_capital_of_france(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh cache dir: the GGUF -> safetensors conversion and the cached load both run.
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    engine: Any = load_torch_engine()
    assert engine.model_name == "SmolLM2-135M-Instruct" and engine.max_model_len == 8192
    assert len(list(tmp_path.glob("*/tidal-cpu-*.safetensors"))) == 1
    engine = load_torch_engine()  # second load maps the cached, laid-out weights
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    engine.add(EngineRequest("q", tok.encode(text), SamplingParams(max_tokens=24, temperature=0)))
    answer = ""
    while engine.has_work():
        answer += "".join(ev.text for ev in engine.step().events)
    assert "Paris" in answer
