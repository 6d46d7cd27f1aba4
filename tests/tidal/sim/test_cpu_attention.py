"""CPU-attention workers: offload, token timing at max(step end, CPU time), wake-up."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import Policy, StepPlan
from tidal.policy.state import CpuPoolState, InstanceRole, InstanceState
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.sim.models import CpuAttnRoofline
from tidal.workload.mix import SimRequest

LINEAR = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


@dataclass(frozen=True)
class ConstCpu:
    seconds: float

    def attn_s(self, num_reqs: int, context_tokens: int, num_workers: int) -> float:
        return self.seconds


class OffloadAll(Policy):
    """Prefill on the GPU, then decode every request with CPU attention."""

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        if inst.waiting:
            r = inst.waiting[0]
            return StepPlan(prefill={r.req_id: r.num_prefill_left})
        dec = [r.req_id for r in inst.running if r.is_decoding]
        if dec:
            return StepPlan(offload=tuple(dec))
        assert inst.cpu is not None
        if inst.offloaded and inst.cpu.busy_until_s <= now:
            return StepPlan(cpu_decode=tuple(r.req_id for r in inst.offloaded))
        return StepPlan()


def test_cpu_decode_timing() -> None:
    setup = InstanceSetup(
        InstanceRole.AGGREGATED,
        512,
        100,
        LINEAR,
        1000.0,
        pcie_bytes_per_s=1e6,
    )
    cpu = CpuPoolState(num_workers=1, model=ConstCpu(0.05))
    sim = Simulator([setup], OffloadAll(), cpu=cpu, check=True)
    rec = sim.run([SimRequest("a", RequestClass.OFFLINE, 0.0, 100, 4)])
    (a,) = rec.requests
    # prefill 0.11; offload step 0.01 + 100 tok * 1000 B / 1e6 B/s = 0.11 -> 0.22;
    # then three CPU decodes, each 0.05 s of CPU (the 0.011 s GPU step is shorter).
    assert a.first_token_s == pytest.approx(0.11)
    assert a.finish_s == pytest.approx(0.22 + 3 * 0.05)
    assert rec.num_offloads == 1
    assert cpu.host_kv_tokens == 0  # freed when it finished


def test_cpu_attention_roofline() -> None:
    m = CpuAttnRoofline(kv_bytes_per_token=1000.0, bytes_per_s_per_worker=1e6, overhead_s=0.001)
    # 0.001 + 2000 tokens * 1000 B / (2 workers * 1e6 B/s) = 1.001 s
    assert m.attn_s(3, 2000, 2) == pytest.approx(1.001)
    assert m.attn_s(0, 0, 2) == 0.0


def test_host_memory_capacity_is_enforced() -> None:
    from tidal.policy.base import PolicyError

    setup = InstanceSetup(InstanceRole.AGGREGATED, 512, 100, LINEAR, 1.0)
    cpu = CpuPoolState(num_workers=1, model=ConstCpu(0.05), host_kv_capacity_tokens=50)
    sim = Simulator([setup], OffloadAll(), cpu=cpu)
    with pytest.raises(PolicyError, match="host memory full"):
        sim.run([SimRequest("a", RequestClass.OFFLINE, 0.0, 100, 4)])
