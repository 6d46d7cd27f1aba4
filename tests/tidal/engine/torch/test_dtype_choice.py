"""The torch engine's dtype, chosen on CPU by measured matmul speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engine.torch import dtype_choice as dc
from tidal.engine.torch.model_config import ModelConfig

TINY = ModelConfig(
    model_type="llama",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def test_decide_picks_the_faster_dtype_by_geometric_mean() -> None:
    fast_small = {"float32": {"1": 10.0, "8": 20.0}, "bfloat16": {"1": 5.0, "8": 30.0}}
    c = dc.decide(fast_small)  # ratios 0.5 and 1.5: geometric mean 0.87
    assert c.dtype == "bfloat16" and c.torch_dtype == torch.bfloat16
    assert "0.50 at batch 1" in c.reason and "1.50 at batch 8" in c.reason
    slow = {"float32": {"1": 10.0, "8": 20.0}, "bfloat16": {"1": 9.0, "8": 40.0}}
    assert dc.decide(slow).dtype == "float32"


def test_choice_is_measured_once_then_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    calls: list[Any] = []
    real = dc.measure_matmuls

    def counted(cfg: ModelConfig, dtype: torch.dtype, *a: Any, **kw: Any) -> dict[str, float]:
        calls.append(dtype)
        return real(cfg, dtype, batches=(1, 2), reps=1)

    monkeypatch.setattr(dc, "measure_matmuls", counted)
    first = dc.choose_dtype(TINY, torch.device("cpu"))
    assert sorted(map(str, calls)) == ["torch.bfloat16", "torch.float32"]
    assert first.dtype in ("float32", "bfloat16") and set(first.matmul_ms) == {
        "float32",
        "bfloat16",
    }
    again = dc.choose_dtype(TINY, torch.device("cpu"))
    assert len(calls) == 2 and again.dtype == first.dtype and again.reason.endswith("(cached)")
    assert (tmp_path / "dtype-choice.json").exists()


def test_env_and_device_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_DTYPE", "float32")
    assert dc.choose_dtype(TINY, torch.device("cpu")).dtype == "float32"
    monkeypatch.delenv("TIDAL_DTYPE")
    assert dc.choose_dtype(TINY, torch.device("cuda")).dtype == "bfloat16"


def test_engine_reports_its_choice(
    make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_DTYPE", "float32")
    engine = make_engine("llama", dtype=None)
    assert engine.model.dtype == torch.float32
    assert engine.dtype_choice is not None and engine.dtype_choice.reason == "TIDAL_DTYPE"
    assert make_engine("llama").dtype_choice is None  # an explicit dtype: nothing chosen
