"""A local Hugging Face model directory as a user has one, written by hand (no `transformers`,
nothing downloaded): config.json, generation_config.json, two safetensors shards with their
index, tokenizer.json and tokenizer_config.json. Random weights of a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.tidal.engine.conftest import EOS, VOCAB, write_tokenizer

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 3, 4, 2
HEAD_DIM = HIDDEN // HEADS

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
}


def write_hf_dir(d: Path, arch: str, seed: int = 0) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        **CONFIGS[arch],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "eos_token_id": EOS,
        "bos_token_id": None,
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": w(VOCAB, HIDDEN),
        "model.norm.weight": 1 + w(HIDDEN),
    }
    if not cfg["tie_word_embeddings"]:
        state["lm_head.weight"] = w(VOCAB, HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
            p + "self_attn.q_proj.weight": w(q, HIDDEN),
            p + "self_attn.k_proj.weight": w(kv, HIDDEN),
            p + "self_attn.v_proj.weight": w(kv, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, q),
            p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
            p + "mlp.up_proj.weight": w(INTER, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        }
        if arch == "qwen2":  # Qwen2's q/k/v carry biases
            state |= {
                p + f"self_attn.{x}_proj.bias": w(n) for x, n in (("q", q), ("k", kv), ("v", kv))
            }
    # Two shards and their index, as checkpoints on the hub are laid out.
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file(
            {k: state[k].contiguous() for k in keys}, str(d / file), metadata={"format": "pt"}
        )
        weight_map |= dict.fromkeys(keys, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    write_tokenizer(d)
    return d
