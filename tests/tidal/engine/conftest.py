"""Tiny random-weight Llama and Qwen2 checkpoints (written with `transformers`, nothing
downloaded) and factories for torch engines over them."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tidal.engine.torch.engine import TorchEngine
from tidal.engine.torch.loader import load_torch_engine

VOCAB = 320  # 256 byte tokens, "<eos>" = 256, the rest unused by the tokenizer
EOS = 256

ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "llama3-rope": dict(
        model_type="llama",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def write_tokenizer(d: Path) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(d / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<eos>"})
    )


def write_tiny_model(d: Path, arch: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        **spec,
    )
    torch.manual_seed(zlib.crc32(arch.encode()) % 1000)  # stable across processes
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    write_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {a: write_tiny_model(root / a, a) for a in ARCHS}


@pytest.fixture(scope="session")
def hf_models(tiny_dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {
        a: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for a, d in tiny_dirs.items()
    }


EngineFactory = Callable[..., TorchEngine]


@pytest.fixture
def make_engine(tiny_dirs: dict[str, Path]) -> EngineFactory:
    def make(arch: str = "llama", **kwargs: Any) -> TorchEngine:
        kwargs.setdefault("kv_cache_tokens", 4096)
        kwargs.setdefault("block_size", 8)
        dtype = kwargs.pop("dtype", "float32")
        return load_torch_engine(str(tiny_dirs[arch]), dtype=dtype, **kwargs)

    return make


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    # Tiny models gain nothing from threads, and CI/shared machines oversubscribe cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dtype calibration's meter of other processes' work reads 0: a test that counts
    calibrations or compares a cached choice with the measured one must not see a cached one
    re-measured because other work on this (shared) machine made it look loaded; the tests of
    that set the meter themselves."""
    from tidal.engine.torch import cpu_meter

    monkeypatch.setattr(cpu_meter.OthersMeter, "cores", lambda self: 0.0)
    monkeypatch.setattr(cpu_meter, "others_busy_now", lambda window_s=0.25: 0.0)
