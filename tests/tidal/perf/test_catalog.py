from __future__ import annotations

import pytest

from tidal.perf.catalog import HARDWARE, MODELS, hardware_spec, model_spec


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("smollm2-135m", 0.135),
        ("llama-2-7b", 6.74),
        ("llama-2-70b", 69.0),
        ("llama-3-8b", 8.03),
        ("qwen2.5-7b", 7.62),
        ("qwen2.5-72b", 72.7),
        ("mistral-7b", 7.24),
        ("yi-34b", 34.4),
    ],
)
def test_parameter_counts_match_the_published_sizes(name: str, billions: float) -> None:
    assert model_spec(name).num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_kv_bytes_per_token_hand_worked() -> None:
    # Llama-2-7B: 2 (K,V) · 32 layers · 32 KV heads · 128 · 2 bytes = 524,288 B = 0.5 MiB
    assert model_spec("llama-2-7b").kv_bytes_per_token() == 524_288
    # Qwen2.5-7B (GQA, 4 KV heads, 28 layers): 2·28·4·128·2 = 57,344 B; TP 2 halves it
    assert model_spec("qwen2.5-7b").kv_bytes_per_token(tp=2) == 28_672


def test_names_are_forgiving_and_unknown_names_explain() -> None:
    assert model_spec("meta-llama/Llama-2-7b-hf") is MODELS["llama-2-7b"]
    assert model_spec("Qwen2.5_7B") is MODELS["qwen2.5-7b"]
    assert hardware_spec("A100") is HARDWARE["a100-80gb"]
    with pytest.raises(KeyError, match="known"):
        model_spec("gpt-5")


def test_catalogue_covers_the_issue_list() -> None:
    for hw in ("a100-40gb", "a100-80gb", "a40", "h100", "h200", "h800", "ascend-910c"):
        spec = hardware_spec(hw)
        assert spec.flops(2) > spec.flops(4) > 0
    assert len(MODELS) == 10


def test_cpu_is_measured_once() -> None:
    a, b = hardware_spec("cpu"), hardware_spec("cpu")
    assert a is b and a.is_measured
    assert a.flops() > 1e8 and a.mem_bw > 1e8 and a.mem_bytes > 1e8
