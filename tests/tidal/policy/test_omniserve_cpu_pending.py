"""OmniServe leaves host room for the CPU decodes in flight on *any* instance of the pool: the
count is the pool's (`CpuPoolState.pending_tokens`, which the simulator keeps), not one policy
object's, so live (one policy object per instance) it is the same as in the simulator."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext, StepPlan
from tidal.policy.registry import make_policy
from tidal.policy.state import CpuPoolState, InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass
from tidal.sim.apply import start_span
from tidal.sim.recorder import Recorder
from tidal.sim.span import finish_span

SLO = Slo(2.0, 0.2)


class _CpuModel:
    def attn_s(self, num_reqs: int, context_tokens: int, num_workers: int) -> float:
        return 0.001 * num_reqs


def _inst(i: int, pool: CpuPoolState, num_blocks: int) -> InstanceState:
    return InstanceState(
        i, InstanceRole.AGGREGATED, 512, 256, 16, num_blocks, num_blocks, LinearStepModel(),
        1.0, 1e9, cpu=pool,
    )  # fmt: skip


def _decoding(rid: str, inst: InstanceState, context: int, phase: Phase) -> ReqState:
    """A BE request decoding with `context` tokens of KV, block-aligned (its next token needs a
    new block), on the GPU (RUNNING) or on the CPU workers (OFFLOADED)."""
    r = ReqState(rid, RequestClass.OFFLINE, 0.0, context, 100, instance_id=inst.instance_id)
    r.phase, r.num_output_tokens, r.num_computed_tokens = phase, 1, context
    if phase is Phase.RUNNING:
        r.num_blocks = context // inst.block_size
        inst.num_free_blocks -= r.num_blocks
        inst.running.append(r)
    else:
        inst.offloaded.append(r)
        assert inst.cpu is not None
        inst.cpu.host_kv_tokens += context
    return r


def _policy():  # type: ignore[no-untyped-def]
    return make_policy("omniserve", PolicyContext(2, (InstanceRole.AGGREGATED,) * 2, SLO, {}, 0))


def test_an_offload_leaves_room_for_another_instances_cpu_decodes_in_flight() -> None:
    pool = CpuPoolState(1, _CpuModel(), host_kv_capacity_tokens=1000)
    a = _inst(0, pool, 100)
    offloaded = [_decoding(f"a{i}", a, 48, Phase.OFFLOADED) for i in range(8)]  # 384 host tokens
    b = _inst(1, pool, 38)
    _decoding("b-fit", b, 16 * 8, Phase.RUNNING)
    victim = _decoding("b-big", b, 16 * 30, Phase.RUNNING)  # 480 tokens: B's KV is full
    # Instance A's own policy object plans CPU decodes; the simulator starts them.
    plan_a = _policy().schedule(a, 0.0)
    assert set(plan_a.cpu_decode) == {r.req_id for r in offloaded}
    rec = Recorder(2, 1.0)
    reqs = {r.req_id: r for r in [*a.offloaded, *b.running]}
    span = start_span(a, plan_a, reqs, 0.0, rec)
    assert pool.pending_tokens == 8  # one host KV token each, when their step ends
    # Room 1000 - 384 - 8 = 608 >= 480 fits; 8 more in flight would not: shrink the pool.
    pool.host_kv_capacity_tokens = 384 + 480 + 7
    plan_b = _policy().schedule(b, 0.0)  # B's own object: it knows A's decodes from the pool
    assert victim.req_id not in plan_b.offload and victim.req_id in plan_b.recompute
    finish_span(a, span, span.end_s, rec)
    assert pool.pending_tokens == 0 and pool.host_kv_tokens == 384 + 8
    pool.host_kv_capacity_tokens = 384 + 8 + 480
    assert victim.req_id in _policy().schedule(b, span.end_s).offload


def test_an_empty_pool_has_nothing_in_flight() -> None:
    pool = CpuPoolState(1, _CpuModel())
    inst = _inst(0, pool, 10)
    assert pool.pending_tokens == 0
    assert _policy().schedule(inst, 0.0) == StepPlan()
