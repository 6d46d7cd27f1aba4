"""Tidal's CPU-attention overflow on strict instances (OmniServe §3.3.5 inside OOCO's pool)."""

from __future__ import annotations

from tests.tidal.policy.test_tidal_policies import RS, run
from tidal.perf.linear import LinearStepModel
from tidal.policy.state import CpuPoolState, InstanceRole, InstanceState, Phase, ReqState
from tidal.policy.tidal.overflow import pick_offloads
from tidal.schemas.enums import RequestClass
from tidal.sim.models import CpuAttnRoofline

# 1,000 B of KV per token, one worker at 1 MB/s, no overhead: 1 s of CPU per 1,000 context tokens.
CPU_MODEL = CpuAttnRoofline(1000.0, bytes_per_s_per_worker=1e6, overhead_s=0.0)


def decoding(rid: str, ctx: int, left: int = 100) -> ReqState:
    r = ReqState(rid, RequestClass.OFFLINE, 0.0, ctx - 1, left + 1)
    r.phase, r.num_computed_tokens, r.num_output_tokens = Phase.RUNNING, ctx, 1
    return r


def strict(offloaded: list[ReqState], capacity: int = 0, parked: int = 0) -> InstanceState:
    cpu = CpuPoolState(1, CPU_MODEL, host_kv_tokens=parked, host_kv_capacity_tokens=capacity)
    inst = InstanceState(
        0, InstanceRole.STRICT, 512, 256, 16, 1000, 1000, LinearStepModel(), 1000.0, 1e9, cpu
    )
    inst.offloaded = offloaded
    return inst


def test_longest_context_that_keeps_the_cpu_step_within_the_bound() -> None:
    # 299 context tokens already on the CPU; candidates of 500, 800 and 100 tokens.
    inst = strict([decoding("x", 299)])
    cands = [decoding("a", 500), decoding("b", 800), decoding("c", 100)]
    # Bound 1.2 s: 299 + 800 + 2 new tokens = 1,101 tokens -> 1.101 s fits, the longest goes.
    assert pick_offloads(inst, [], cands, 1.2, None) == ["b"]
    # Bound 1.0 s: "b" does not fit, the next longest does (299 + 500 + 2 -> 0.801 s).
    assert pick_offloads(inst, [], cands, 1.0, None) == ["a"]
    assert pick_offloads(inst, [], cands, 0.3, None) == []  # not even "c" (0.401 s)


def test_decodes_alg2_left_out_go_before_planned_ones() -> None:
    # §3.3.5 offloads what cannot be scheduled on the GPU first, however short.
    planned, left_out = [decoding("b", 800)], [decoding("c", 100)]
    assert pick_offloads(strict([]), left_out, planned, 10.0, None) == ["c"]
    assert pick_offloads(strict([]), [], planned, 10.0, None) == ["b"]


def test_respects_host_memory() -> None:
    cands = [decoding("b", 600), decoding("c", 200)]
    # 500 tokens of host room: "b" (600 + its next token) does not fit, "c" does.
    assert pick_offloads(strict([]), [], cands, 10.0, 500) == ["c"]
    assert pick_offloads(strict([]), [], cands, 10.0, 200) == []  # 200 + 1 > 200


def test_overflow_leaves_planned_decodes_on_the_gpu_while_kv_is_plentiful() -> None:
    # A decode on the CPU makes a token every num_layers steps; with KV to spare nothing waits
    # for the blocks it would free, so the planned decodes stay (before: offloaded one a step).
    on = run("tidal", RS, {}, cpu_workers=4)
    off = run("tidal", RS, {"cpu_overflow": False}, cpu_workers=4)
    for rec in (on, off):
        assert all(r.finish_s is not None for r in rec.requests)
    assert on.num_offloads == off.num_offloads == 0
