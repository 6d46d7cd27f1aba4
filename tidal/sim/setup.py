"""What the simulator is told about each instance (`InstanceSetup`)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.perf.api import StepModel
from tidal.policy.state import InstanceRole


@dataclass(frozen=True)
class InstanceSetup:
    """Static description of one instance for the simulator."""

    role: InstanceRole
    chunk_size: int  # token budget of one step
    num_blocks: int  # GPU KV blocks
    step_model: StepModel
    kv_bytes_per_token: float  # per GPU of the instance
    block_size: int = 16
    max_batch_reqs: int = 256
    pcie_bytes_per_s: float = 25e9  # GPU <-> host copies (swap, offload)
    num_layers: int = 32  # layer boundaries a `StepPlan.layer_cut` step is cut at
    ckpt_capacity_tokens: int = 0  # host memory for offline KV checkpoints, tokens (0: none)

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("chunk_size, num_blocks and block_size must be >= 1")
        if self.max_batch_reqs < 1 or self.kv_bytes_per_token <= 0 or self.pcie_bytes_per_s <= 0:
            raise ValueError("max_batch_reqs, kv_bytes_per_token and pcie_bytes_per_s must be > 0")
        if self.ckpt_capacity_tokens < 0:
            raise ValueError(f"ckpt_capacity_tokens must be >= 0, got {self.ckpt_capacity_tokens}")
