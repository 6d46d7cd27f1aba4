"""Catalogues of model shapes and accelerators that the latency models are built from.

Model shapes are copied from each model's public `config.json` (Hugging Face hub); hardware figures
are vendor datasheet peaks (dense, no sparsity). The local CPU is measured once, lazily, on first
use (`hardware_spec("cpu")`), with a small numpy GEMM and a large copy.

Names are case-insensitive and ignore '_' vs '-' ("Qwen2.5-7B", "qwen2.5_7b"); a path to a local
Hugging Face model directory names the shape in its `config.json`.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer (Llama-style: GQA attention, gated MLP)."""

    name: str
    num_layers: int
    hidden: int  # model (residual stream) width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); == num_heads for MHA
    head_dim: int
    intermediate: int  # MLP width (each of gate and up)
    vocab: int
    bytes_per_value: int = 2  # bf16 / fp16 weights, activations and KV
    gated_mlp: bool = True  # SwiGLU: gate+up fused GEMM of width 2*intermediate
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"{self.name}: {f} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads must be a multiple of num_kv_heads")
        if self.bytes_per_value not in (1, 2, 4):
            raise ValueError(f"{self.name}: bytes_per_value must be 1, 2 or 4")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameters (weights only; norms and biases are negligible and left out)."""
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp) + emb

    def weight_bytes(self, tp: int = 1) -> float:
        """Weight bytes held by one of `tp` tensor-parallel GPUs."""
        return self.num_params * self.bytes_per_value / tp

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """KV-cache bytes one token occupies on one of `tp` GPUs: K and V, every layer."""
        # 2 (K,V) * L * H_kv * head_dim * d, split over TP (kv heads replicate if H_kv < tp)
        kv_heads = max(self.num_kv_heads / tp, 1.0)
        return 2.0 * self.num_layers * kv_heads * self.head_dim * self.bytes_per_value


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator: datasheet peaks (dense) and capacity."""

    name: str
    peak_flops: dict[str, float]  # dtype -> FLOP/s ("bf16", "fp16", "fp32", "fp8", "int8")
    mem_bw: float  # bytes/s, device memory
    mem_bytes: float  # device memory capacity, bytes
    link_bw: float  # bytes/s per direction, GPU-GPU interconnect used by TP collectives
    is_measured: bool = False  # True for the local CPU (measured, not a datasheet)

    def __post_init__(self) -> None:
        if self.mem_bw <= 0 or self.mem_bytes <= 0 or self.link_bw <= 0:
            raise ValueError(f"{self.name}: bandwidths and capacity must be > 0")
        if not self.peak_flops or min(self.peak_flops.values()) <= 0:
            raise ValueError(f"{self.name}: peak_flops must be a non-empty map of positive rates")

    def flops(self, bytes_per_value: int = 2) -> float:
        """Peak FLOP/s for the dtype of that width (2 -> bf16, 4 -> fp32, 1 -> fp8/int8)."""
        keys = {1: ("fp8", "int8", "bf16"), 2: ("bf16", "fp16"), 4: ("fp32",)}[bytes_per_value]
        for k in keys:
            if k in self.peak_flops:
                return self.peak_flops[k]
        return max(self.peak_flops.values())


def _m(
    name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, **kw: object
) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv, hidden // heads, inter, vocab, **kw)  # type: ignore[arg-type]


# From each model's config.json: num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, intermediate_size, vocab_size (head_dim = hidden / heads for all of them).
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _m("smollm2-135m", 30, 576, 9, 3, 1536, 49152, tie_embeddings=True),
        _m("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
        _m("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
        _m("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
        _m("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064),
        _m("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064),
        _m("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064),
        _m("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064),
        _m("mistral-7b", 32, 4096, 32, 8, 14336, 32000),
        _m("yi-34b", 60, 7168, 56, 8, 20480, 64000),
    )
}

_T = 1e12
_GB = 1e9
_GIB = 2**30

# Datasheet dense peaks. Interconnect: NVLink per-direction bandwidth (A40: PCIe 4.0 x16).
HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec(
            "a100-40gb",
            {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 19.5 * _T, "int8": 624 * _T},
            1555 * _GB,
            40 * _GIB,
            300 * _GB,
        ),
        HardwareSpec(
            "a100-80gb",
            {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 19.5 * _T, "int8": 624 * _T},
            2039 * _GB,
            80 * _GIB,
            300 * _GB,
        ),
        HardwareSpec(
            "a40",
            {"bf16": 149.7 * _T, "fp16": 149.7 * _T, "fp32": 37.4 * _T, "int8": 299.3 * _T},
            696 * _GB,
            48 * _GIB,
            32 * _GB,
        ),
        HardwareSpec(
            "h100",
            {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 67 * _T, "fp8": 1979 * _T},
            3350 * _GB,
            80 * _GIB,
            450 * _GB,
        ),
        HardwareSpec(
            "h200",
            {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 67 * _T, "fp8": 1979 * _T},
            4800 * _GB,
            141 * _GIB,
            450 * _GB,
        ),
        # H800: H100 compute and HBM, NVLink cut to 400 GB/s bidirectional.
        HardwareSpec(
            "h800",
            {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 67 * _T, "fp8": 1979 * _T},
            3350 * _GB,
            80 * _GIB,
            200 * _GB,
        ),
        # NOTE: OOCO §5.1.1/§5.3 treat one 910c chip (die) as A100-SXM class; per-die figures
        # (half of the dual-die package) at about A100 level, 64 GiB HBM per die.
        HardwareSpec(
            "ascend-910c",
            {"bf16": 320 * _T, "fp16": 320 * _T, "fp32": 20 * _T, "int8": 640 * _T},
            1600 * _GB,
            64 * _GIB,
            196 * _GB,
        ),
    )
}

_ALIASES = {
    "a100": "a100-80gb",
    "h100-80gb": "h100",
    "h100-sxm": "h100",
    "910c": "ascend-910c",
    "llama2-7b": "llama-2-7b",
    "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b",
    "mistral-7b-v0.1": "mistral-7b",
}


def _norm(name: str) -> str:
    n = name.strip().lower().replace("_", "-").split("/")[-1]
    n = n.removesuffix("-hf").removesuffix("-instruct")
    return _ALIASES.get(n, n)


def model_spec(name: str) -> ModelSpec:
    """A catalogue model by name, or the shape of a local Hugging Face directory's config.json."""
    if (cfg_path := Path(name).expanduser() / "config.json").is_file():
        return _hf_spec(Path(name).name, json.loads(cfg_path.read_text()))
    key = _norm(name)
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[key]


def _hf_spec(name: str, d: dict[str, Any]) -> ModelSpec:
    heads = int(d["num_attention_heads"])
    dtype = str(d.get("torch_dtype") or d.get("dtype") or "bfloat16")
    return ModelSpec(
        name,
        num_layers=int(d["num_hidden_layers"]),
        hidden=int(d["hidden_size"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        intermediate=int(d["intermediate_size"]),
        vocab=int(d["vocab_size"]),
        bytes_per_value=4 if dtype == "float32" else 2,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def hardware_spec(name: str) -> HardwareSpec:
    key = _norm(name)
    if key == "cpu":
        return measure_cpu()
    if key not in HARDWARE:
        known = ", ".join([*sorted(HARDWARE), "cpu"])
        raise KeyError(f"unknown hardware {name!r}; known: {known}")
    return HARDWARE[key]


@functools.cache
def measure_cpu() -> HardwareSpec:
    """Measure the local CPU once: fp32 GEMM FLOP/s and copy bandwidth (best of a few runs)."""
    import numpy as np

    n = 512
    a = np.ones((n, n), dtype=np.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * n**3 / max(best, 1e-9)
    buf = np.ones(8 * 2**20, dtype=np.float32)  # 32 MiB: past the last-level cache
    dst = np.empty_like(buf)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, buf)
        best = min(best, time.perf_counter() - t0)
    bw = 2.0 * buf.nbytes / max(best, 1e-9)  # read + write
    try:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        mem = 8.0 * _GIB
    # bf16 on CPU runs through fp32 kernels (or slower): use the fp32 rate for every dtype.
    return HardwareSpec("cpu", {"fp32": flops, "bf16": flops}, bw, mem, bw, is_measured=True)
