"""The policy adapter mirrors an engine's checkpoints into the policy's `InstanceState`, so a
policy such as `aggregated` with `checkpoint_offline` plans checkpoints and releases live."""

from __future__ import annotations

from services.instance.policy_adapter import PolicyAdapter
from tidal.engine.api import SeqSnapshot
from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import InstanceRole, Slo
from tidal.schemas.enums import RequestClass

KVB = 100.0  # bytes of KV per token


def make_adapter(checkpoint_offline: bool, capacity_bytes: int | None) -> PolicyAdapter:
    ctx = PolicyContext(
        num_instances=1,
        roles=(InstanceRole.AGGREGATED,),
        online_slo=Slo(1.0, 0.1),
        params={"checkpoint_offline": checkpoint_offline},
    )
    adapter = PolicyAdapter.build(
        policy=make_policy("aggregated", ctx),
        index=0,
        instance_id="i0",
        role="aggregated",
        chunk_size=64,
        max_batch_reqs=8,
        block_size=16,
        num_blocks=100,
        step_model=LinearStepModel(0.01, 0.0, 0.0, 0.0),
        step_model_spec="linear:0.01,0,0,0",
        kv_bytes_per_token=KVB,
    )
    if capacity_bytes is not None:
        adapter.checkpoint_capacity = lambda: capacity_bytes
    return adapter


def snap(rid: str, computed: int, ckpt: int = 0, status: str = "running") -> SeqSnapshot:
    return SeqSnapshot(
        req_id=rid,
        req_class=RequestClass.OFFLINE,
        arrival_s=1.0,
        num_prompt_tokens=30,
        max_output_tokens=100,
        num_computed_tokens=computed,
        num_output_tokens=computed - 29,
        num_blocks=-(-computed // 16) if status == "running" else 0,
        status=status,
        num_checkpointed_tokens=ckpt,
        is_released=status == "swapped" and ckpt > 0,
    )


def test_the_engine_checkpoints_are_the_policy_s_and_it_plans_more() -> None:
    adapter = make_adapter(True, capacity_bytes=int(200 * KVB))  # room for 200 tokens
    adapter.sync([snap("a", 40, ckpt=16), snap("b", 50), snap("c", 32, 32, "swapped")], 90, 0.0)
    inst = adapter.inst
    assert (inst.ckpt_capacity_tokens, inst.ckpt_tokens) == (200, 16 + 32)
    a, b, c = (adapter.reqs[r] for r in "abc")
    assert (a.num_checkpointed_tokens, b.num_checkpointed_tokens) == (16, 0)
    assert c.is_released and c.num_checkpointed_tokens == 32
    plan = adapter.plan(10.0)
    # the new full blocks of every offline decode: a's second block, b's three
    assert set(plan.checkpoint) == {"a", "b"}


def test_without_checkpoint_memory_the_policy_plans_none() -> None:
    for adapter in (make_adapter(True, None), make_adapter(True, 0), make_adapter(False, 10**6)):
        adapter.sync([snap("a", 40), snap("b", 50)], 90, 0.0)
        plan = adapter.plan(10.0)
        assert plan.checkpoint == () and plan.release == ()
        assert plan.decode  # it still runs them
