"""Tidal's own overflow rule (a planned offline decode moves to the CPU-attention workers) only
while the strict instance's offline prefill waits for KV (`tidal.policy.tidal.overflow`)."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import (
    CpuPoolState,
    InstanceRole,
    InstanceState,
    Phase,
    PolicyContext,
    ReqState,
    Slo,
)
from tidal.policy.registry import make_policy
from tidal.policy.tidal.overflow import kv_binds
from tidal.schemas.enums import RequestClass
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
