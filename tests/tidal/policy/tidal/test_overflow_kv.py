"""Tidal's own overflow rule (a planned offline decode moves to the CPU-attention workers) only
while the strict instance's offline prefill waits for KV (`tidal.policy.tidal.overflow`)."""

from __future__ import annotations

from tests.tidal.policy.test_tidal_policies import KV_BYTES, attainment, workload
from tests.tidal.policy.test_tidal_policies import MODEL as POLICY_MODEL
from tests.tidal.policy.test_tidal_policies import SLO as POLICY_SLO
from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import CpuPoolState, InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.policy.tidal.overflow import kv_binds
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.sim.models import CpuAttnRoofline

SLO = Slo(3.0, 0.25)
MODEL = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


def decoding(rid: str, ctx: int) -> ReqState:
    r = ReqState(rid, RequestClass.OFFLINE, 0.0, ctx - 1, 32)
    r.phase, r.num_computed_tokens, r.num_output_tokens = Phase.RUNNING, ctx, 1
    r.num_blocks = -(-(ctx + 1) // 16)
    r.first_token_s = 0.0
    return r


def prompt(rid: str, n: int) -> ReqState:
    r = ReqState(rid, RequestClass.OFFLINE, 0.0, n, 32)
    r.phase = Phase.WAITING
    return r


def strict(free_blocks: int) -> InstanceState:
    cpu = CpuPoolState(1, CpuAttnRoofline(1000.0), host_kv_capacity_tokens=10**6)
    inst = InstanceState(
        1, InstanceRole.STRICT, 256, 256, 16, 4096, free_blocks, MODEL, 1000.0, 1e9, cpu
    )
    inst.running = [decoding("d1", 288), decoding("d2", 200)]
    inst.waiting = [prompt("p", 256)]
    inst.num_waiting_tokens = 256
    return inst


def plan_of(inst: InstanceState):  # type: ignore[no-untyped-def]
    ctx = PolicyContext(2, (InstanceRole.RELAXED, InstanceRole.STRICT), SLO, {})
    return make_policy("tidal", ctx).schedule(inst, 0.0)


def test_kv_binds_when_the_next_chunk_does_not_fit() -> None:
    inst = strict(free_blocks=15)  # 240 tokens free, the prompt's chunk wants 256
    assert kv_binds(inst, inst.waiting)
    inst.num_free_blocks = 16
    assert not kv_binds(inst, inst.waiting)
    assert not kv_binds(inst, [])  # nothing waits: nothing binds


def test_planned_decode_moves_to_the_cpu_only_while_kv_binds() -> None:
    roomy = plan_of(strict(free_blocks=3000))
    assert roomy.offload == ()  # both decodes stay on the GPU ...
    assert set(roomy.decode) == {"d1", "d2"}
    assert roomy.prefill == {"p": 254}  # ... and the prompt takes the rest of the chunk
    tight = plan_of(strict(free_blocks=10))
    assert tight.offload == ("d1",)  # the longest context goes, its 19 blocks to the prompt
    assert "d1" not in tight.decode
    assert tight.prefill.get("p", 0) > 0


def offloaded(rid: str, ctx: int) -> ReqState:
    r = decoding(rid, ctx)
    r.phase, r.num_blocks = Phase.OFFLOADED, 0
    r.last_token_s = 1.0
    return r


def test_offloaded_decode_comes_back_once_nothing_binds() -> None:
    inst = strict(free_blocks=3000)
    inst.waiting, inst.num_waiting_tokens = [], 0
    inst.offloaded = [offloaded("o1", 300)]
    plan = plan_of(inst)
    assert plan.recall == ("o1",)
    assert "o1" not in plan.cpu_decode  # it decodes on the GPU from the next step
    assert plan.offload == ()


def test_no_recall_while_a_prompt_waits_or_kv_is_short() -> None:
    inst = strict(free_blocks=3000)  # a prompt waits: its blocks come first
    inst.offloaded = [offloaded("o1", 300)]
    assert plan_of(inst).recall == ()
    inst.waiting, inst.num_waiting_tokens = [], 0
    inst.num_free_blocks = 800  # 20 % of 4,096 blocks stays free for pushed online requests
    plan = plan_of(inst)
    assert plan.recall == ()
    assert plan.cpu_decode == ("o1",)  # it goes on decoding with CPU attention


def test_in_the_simulator_a_strict_instance_short_of_kv_offloads_and_finishes_everything() -> None:
    # The mixed workload of test_tidal_policies with 500 KV blocks (8,000 tokens) on the strict
    # instance: its offline prompts wait for KV, so planned decodes move to the CPU workers
    # (with 3,000 blocks none does: test_tidal_overflow.py), and every request still ends.
    roles = [InstanceRole.RELAXED, InstanceRole.STRICT]
    setups = [
        InstanceSetup(roles[0], 2048, 3000, POLICY_MODEL, KV_BYTES),
        InstanceSetup(roles[1], 2048, 500, POLICY_MODEL, KV_BYTES),
    ]
    ctx = PolicyContext(2, tuple(roles), POLICY_SLO, {}, seed=3)
    cpu = CpuPoolState(4, CpuAttnRoofline(KV_BYTES), host_kv_capacity_tokens=10**8)
    rec = Simulator(setups, make_policy("tidal", ctx), cpu=cpu, horizon_s=1000).run(workload())
    assert rec.num_offloads > 0
    assert all(r.finish_s is not None for r in rec.requests)
    assert attainment(rec) == 1.0
