"""Configuration of the torch engine, and its default dtype per device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.engine.torch import cpu_caps


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int = 65536  # KV capacity in tokens (rounded down to whole blocks)
    max_model_len: int | None = None  # prompt + output cap; None = the model's context length
    token_budget: int = 512  # default planner: tokens per step
    chunk_size: int = 512  # default planner: prefill tokens per request per step
    max_num_seqs: int = 256  # default planner: requests per step
    enable_prefix_cache: bool = True
    profile_modules: bool = False  # fill StepTelemetry.module_s (adds a sync per module on CUDA)
    step_log: str | None = None  # append each step's telemetry as a JSON line to this path
    checkpoint_host_bytes: int = 0  # host memory for offline KV checkpoints (ConServe), bytes;
    # 0: none, and plans with `checkpoint`/`release` are refused (`no_kv_checkpoint`)
    checkpoint_background: bool = True  # copy checkpoints on a worker thread (CUDA: a side
    # stream) beside the next step; False: synchronously, inside the `checkpoint` stage

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_cache_tokens < self.block_size:
            raise ValueError("block_size must be >= 1 and kv_cache_tokens >= block_size")
        if self.checkpoint_host_bytes < 0:
            raise ValueError(
                f"checkpoint_host_bytes must be >= 0 (0: no checkpoints), "
                f"got {self.checkpoint_host_bytes}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX, `cpu_caps`), else fp32."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_caps.probe().has_native_bf16 else torch.float32
