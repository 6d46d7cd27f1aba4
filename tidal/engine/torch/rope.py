"""RoPE's inverse frequencies and attention scaling for each variant a config names: default,
linear, llama3 and yarn (as HF's `rope_type`)."""

from __future__ import annotations

import math

import torch

from tidal.engine.torch.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (D/2,) and attention scaling for the config's RoPE variant."""
    D, base, rs = config.head_dim, config.rope_theta, config.rope_scaling
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    kind = config.rope_type
    if kind == "linear":
        return inv / float(rs["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = (
            float(rs["factor"]),
            float(rs["low_freq_factor"]),
            float(rs["high_freq_factor"]),
        )
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, inv_l), 1.0
    if kind == "yarn":
        factor = float(rs["factor"])
        old = float(rs.get("original_max_position_embeddings") or config.max_position_embeddings)
        fast, slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

        def corr(rot: float) -> float:
            return (D * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), D - 1)
        ramp = (torch.arange(D // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        extrap = 1 - ramp.clamp(0, 1)
        inv = (inv / factor) * (1 - extrap) + inv * extrap
        scale = float(rs.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
        return inv, scale
    return inv, 1.0
