"""Model configuration of the Llama-architecture decoder family (Llama 2/3, Qwen2/2.5, Mistral,
SmolLM2).

Parsed from an HF `config.json` (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
`rope_parameters`) or from GGUF metadata. Only what the forward pass needs is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder of the Llama family; field names follow HF `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {"rope_type": ..., params}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mistral / Qwen2 sliding-window attention span, tokens (0: none). The engine attends over
    # the whole context, so it serves such a model only up to this many tokens.
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {self.model_type!r}; know {SUPPORTED_ARCHS}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; know {SUPPORTED_ROPE_TYPES}")

    @property
    def rope_type(self) -> str:
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, n = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n * per_layer + emb + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        heads = int(d["num_attention_heads"])
        rope_params = dict(d.get("rope_parameters") or {})
        rope_scaling = dict(d.get("rope_scaling") or {})
        theta = float(rope_params.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_scaling.update(rope_params)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        model_type = str(d.get("model_type", "llama"))
        # Mistral applies its window whenever one is set; Qwen2 only with use_sliding_window.
        window = d.get("sliding_window") if model_type == "mistral" else None
        if d.get("use_sliding_window"):
            window = d.get("sliding_window")
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama declares them with attention_bias.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            sliding_window=int(window or 0),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-loadable `config.json` (used for the GGUF -> safetensors cache)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
            self.model_type, "MistralForCausalLM"
        )
        rope = {"rope_type": self.rope_type, **self.rope_scaling}
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_type == "default" else rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "eos_token_id": list(self.eos_token_ids) or None,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": "float32",
        }
