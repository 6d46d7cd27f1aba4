"""Hand-built instance states for the preemption tests (`test_preempt`, `test_class_preempt`)."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.state import InstanceRole, InstanceState


def make_instance(blocks: int = 100, iid: int = 0, chunk_size: int = 64) -> InstanceState:
    """An aggregated instance `iid` with `blocks` KV blocks of 16 tokens, all free, and a step
    time of 10 ms whatever it runs."""
    return InstanceState(
        instance_id=iid,
        role=InstanceRole.AGGREGATED,
        chunk_size=chunk_size,
        max_batch_reqs=8,
        block_size=16,
        num_blocks=blocks,
        num_free_blocks=blocks,
        step_model=LinearStepModel(0.01, 0.0, 0.0, 0.0),
        kv_bytes_per_token=1.0,
        pcie_bytes_per_s=1.0,
    )
