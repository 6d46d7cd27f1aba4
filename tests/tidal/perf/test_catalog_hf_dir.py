"""A local Hugging Face directory names its own shape for the latency models."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.perf.catalog import model_spec


def test_model_spec_reads_a_directorys_config(tmp_path: Path) -> None:
    d = tmp_path / "my-model"
    d.mkdir()
    cfg = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    spec = model_spec(str(d))
    catalogued = model_spec("smollm2-135m")  # the same shape, by name
    assert spec.name == "my-model" and spec.bytes_per_value == 2
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        catalogued.num_layers,
        catalogued.hidden,
        catalogued.num_heads,
        catalogued.num_kv_heads,
        catalogued.head_dim,
    )
    assert (spec.intermediate, spec.vocab, spec.tie_embeddings) == (1536, 49152, True)
