"""The policy adapter mirrors an engine's checkpoints into the policy's `InstanceState`, so a
policy such as `aggregated` with `checkpoint_offline` plans checkpoints and releases live; and
its steps' measured time against the model's, so `tidal` fills a strict step at the speed the
instance really runs."""

from __future__ import annotations

import dataclasses

import pytest

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


def test_steps_slower_than_the_model_shrink_what_tidal_packs_into_a_strict_step() -> None:
    # Live, two engines on one core each run a step in about twice the profile's time: the
    # adapter measures it and `tidal`'s strict step carries only what fits at that speed.
    model = LinearStepModel(0.01, 1e-4, 0.0, 0.0)  # 10 ms + 0.1 ms a token
    roles = (InstanceRole.RELAXED, InstanceRole.STRICT)
    ctx = PolicyContext(2, roles, Slo(2.0, 0.05), {"cpu_offload": False})
    adapter = PolicyAdapter.build(
        policy=make_policy("tidal", ctx),
        index=1,
        instance_id="i1",
        role="strict",
        chunk_size=512,
        max_batch_reqs=64,
        block_size=16,
        num_blocks=1000,
        step_model=model,
        step_model_spec="linear:0.01,1e-4,0,0",
        kv_bytes_per_token=KVB,
    )
    online = dataclasses.replace(
        snap("on", 300), req_class=RequestClass.ONLINE, num_output_tokens=2
    )
    offline = dataclasses.replace(snap("off", 0, status="waiting"), num_prompt_tokens=2000)
    adapter.sync([online, offline], 900, 10.0)
    first = adapter.plan(10.0)
    assert first.decode == ("on",) and first.prefill["off"] == 299  # 40 ms: 0.8 x 50 ms
    assert adapter.predicted_s == pytest.approx(0.04)
    for _ in range(8):  # each step took twice the model's time
        adapter.on_step_end(2 * adapter.predicted_s)
    assert adapter.inst.step_time_scale == pytest.approx(2.0)
    adapter.sync([online, offline], 900, 10.5)
    second = adapter.plan(10.5)
    assert second.prefill["off"] == 99  # 20 ms of the model: 40 ms at the measured speed
    assert 2 * adapter.predicted_s <= 0.04 + 1e-9
