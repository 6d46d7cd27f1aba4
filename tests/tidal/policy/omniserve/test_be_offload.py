"""OmniServe §3.3.5 BE decoding control on hand-built states: BE decodes that cannot stay on the
GPU (out of KV, or past the TPOT bound) go to the CPU-attention workers when the node has them
and are preempted / left waiting when it does not; offloaded decodes come back only after the
delayed swap-in patience (§3.2.4)."""

from __future__ import annotations

from typing import Any

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import Policy, PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import CpuPoolState, InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass
from tidal.sim.models import CpuAttnRoofline

SLO = Slo(2.0, 0.2)
MODEL = LinearStepModel()  # 10 ms + 10 us/token + 0.1 us per KV token read


def _cpu(busy_until_s: float = 0.0) -> CpuPoolState:
    return CpuPoolState(
        num_workers=4,
        model=CpuAttnRoofline(1.0),
        busy_until_s=busy_until_s,
        host_kv_capacity_tokens=10**9,
    )


def _inst(num_blocks: int, cpu: CpuPoolState | None) -> InstanceState:
    return InstanceState(
        0, InstanceRole.AGGREGATED, 512, 256, 16, num_blocks, num_blocks, MODEL, 1.0, 1e12, cpu=cpu
    )


def _be_decode(rid: str, inst: InstanceState, context: int, blocks: int) -> ReqState:
    """A BE request decoding with `context` KV tokens resident in `blocks` GPU blocks."""
    r = ReqState(rid, RequestClass.OFFLINE, 0.0, context, 10_000, None, instance_id=0)
    r.phase, r.num_output_tokens, r.num_computed_tokens = Phase.RUNNING, 1, context
    r.num_blocks = blocks
    inst.running.append(r)
    inst.num_free_blocks -= blocks
    return r


def _policy(**params: Any) -> Policy:
    ctx = PolicyContext(1, (InstanceRole.AGGREGATED,), SLO, params, seed=0)
    return make_policy("omniserve", ctx)


def test_out_of_kv_be_decodes_offloaded_with_cpu_workers_preempted_without() -> None:
    # 4 BE decodes, each with exactly 2 full blocks; the next token needs a 3rd block each and
    # no block is free. Freeing the two newest (4 blocks) makes room for the other two.
    for cpu in (_cpu(), None):
        inst = _inst(8, cpu)
        for i in range(4):
            _be_decode(f"be{i}", inst, 32, 2)
        plan = _policy().schedule(inst, 0.0)
        if cpu is not None:
            assert set(plan.offload) == {"be3", "be2"} and plan.recompute == ()
        else:
            assert set(plan.recompute) == {"be3", "be2"} and plan.offload == ()
        assert not plan.decode and not plan.prefill


def test_be_decodes_past_the_tpot_bound_go_to_the_cpu() -> None:
    # Each 500k-token context adds 50 ms of attention: 10 ms + 3 x 50 ms fits the 200 ms TPOT
    # bound, a 4th would not (§3.3.5). FCFS keeps the oldest three on the GPU.
    for cpu in (_cpu(), None):
        inst = _inst(1_000_000, cpu)
        for i in range(6):
            _be_decode(f"be{i}", inst, 500_000, 31_251)
        plan = _policy().schedule(inst, 0.0)
        assert plan.decode == ("be0", "be1", "be2")
        assert plan.offload == (("be3", "be4", "be5") if cpu is not None else ())


def _offloaded(inst: InstanceState, n: int) -> None:
    assert inst.cpu is not None
    for i in range(n):
        r = ReqState(f"off{i}", RequestClass.OFFLINE, 0.0, 1000, 10_000, None, instance_id=0)
        r.phase, r.num_output_tokens, r.num_computed_tokens = Phase.OFFLOADED, 5, 1004
        inst.offloaded.append(r)
        inst.cpu.host_kv_tokens += r.num_computed_tokens


def _recall_step(pol: Policy, inst: InstanceState, max_calls: int) -> int | None:
    """1-based index of the first schedule() call that recalls an offloaded decode."""
    for k in range(1, max_calls + 1):
        if pol.schedule(inst, 0.0).recall:
            return k
    return None


def test_delayed_swap_in_waits_for_patience_slack_steps() -> None:
    # An idle GPU (slack every step) and busy CPU workers (no piggyback this step): with delayed
    # swap-in the recall comes only after `swap_in_patience_steps` slack steps; without it, at once.
    cases: list[tuple[dict[str, Any], int]] = [
        ({}, 5),
        ({"swap_in_patience_steps": 2}, 3),
        ({"delayed_swap_in": False}, 1),
    ]
    for params, expected in cases:
        inst = _inst(10_000, _cpu(busy_until_s=10.0))
        _offloaded(inst, 3)
        assert _recall_step(_policy(**params), inst, 10) == expected


def test_no_swap_in_while_the_gpu_has_ls_prefill_waiting() -> None:
    inst = _inst(10_000, _cpu(busy_until_s=10.0))
    _offloaded(inst, 2)
    ls = ReqState("ls", RequestClass.ONLINE, 0.0, 200, 50, SLO, instance_id=0)
    ls.phase = Phase.WAITING
    inst.waiting.append(ls)
    inst.num_waiting_tokens += 200
    pol = _policy(delayed_swap_in=False)
    for _ in range(6):
        plan = pol.schedule(inst, 0.0)
        assert not plan.recall and plan.prefill == {"ls": 200}


def test_offload_stops_at_host_memory_capacity() -> None:
    # Host memory holds two 500k-token contexts: of the three BE decodes past the TPOT bound only
    # the first two are offloaded, the third waits on the GPU (the simulator would reject more).
    cpu = _cpu()
    cpu.host_kv_capacity_tokens = 1_000_000
    inst = _inst(1_000_000, cpu)
    for i in range(6):
        _be_decode(f"be{i}", inst, 500_000, 31_251)
    plan = _policy().schedule(inst, 0.0)
    assert plan.decode == ("be0", "be1", "be2")
    assert plan.offload == ("be3", "be4")


def test_cpu_decodes_need_host_room_for_their_new_token() -> None:
    # Three offloaded decodes, host memory one token short of their next tokens: only two of them
    # decode on the CPU this step (each new token is one more KV token in host memory).
    cpu = _cpu()
    inst = _inst(10_000, cpu)
    _offloaded(inst, 3)
    cpu.host_kv_capacity_tokens = cpu.host_kv_tokens + 2
    plan = _policy().schedule(inst, 0.0)
    assert len(plan.cpu_decode) == 2


def test_offload_copies_spend_the_tpot_budget() -> None:
    # Same overflow as above, but each 500k-token KV copy takes 19 ms on PCIe: ~160 ms of GPU
    # work leaves ~40 ms, so two copies fit the 200 ms bound and the third BE decode waits for
    # a later step (§3.3.5).
    inst = _inst(1_000_000, _cpu())
    inst.pcie_bytes_per_s = 500_000 / 0.019  # bytes/s, at 1 B of KV per token
    for i in range(6):
        _be_decode(f"be{i}", inst, 500_000, 31_251)
    plan = _policy().schedule(inst, 0.0)
    assert plan.decode == ("be0", "be1", "be2")
    assert plan.offload == ("be3", "be4")
