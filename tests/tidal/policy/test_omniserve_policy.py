"""The `omniserve` policy's step: LS prefill steps are not slowed by BE GPU decodes, and LS
requests are routed by LS prefill queued (BE prompts do not count)."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass

SLO = Slo(2.0, 0.2)
MODEL = LinearStepModel()


def _inst(i: int) -> InstanceState:
    return InstanceState(i, InstanceRole.AGGREGATED, 512, 256, 16, 10_000, 10_000, MODEL, 1.0, 1e9)


def _req(rid: str, online: bool, prompt: int, out_done: int, inst: InstanceState) -> ReqState:
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    r = ReqState(rid, cls, 0.0, prompt, 100, SLO if online else None, instance_id=inst.instance_id)
    if out_done:  # decoding: prompt prefilled, `out_done` tokens out
        r.phase, r.num_output_tokens = Phase.RUNNING, out_done
        r.num_computed_tokens = prompt + out_done - 1
        r.num_blocks = inst.blocks_for(r.num_computed_tokens + 1)
        inst.running.append(r)
        inst.num_free_blocks -= r.num_blocks
    else:
        r.phase = Phase.WAITING
        inst.waiting.append(r)
        inst.num_waiting_tokens += prompt
    return r


def _policy():  # type: ignore[no-untyped-def]
    ctx = PolicyContext(2, (InstanceRole.AGGREGATED,) * 2, SLO, {}, seed=0)
    return make_policy("omniserve", ctx)


def test_ls_prefill_step_carries_no_be_gpu_decodes() -> None:
    inst = _inst(0)
    be = [_req(f"be{i}", False, 4000, 5, inst) for i in range(8)]
    ls_dec = _req("ls-dec", True, 300, 3, inst)
    plan = _policy().schedule(inst, 0.0)
    assert set(plan.decode) == {r.req_id for r in be} | {ls_dec.req_id}  # no LS prefill: BE runs
    ls_new = _req("ls-new", True, 200, 0, inst)
    plan = _policy().schedule(inst, 0.0)
    assert plan.prefill.get(ls_new.req_id) == 200
    assert plan.decode == (ls_dec.req_id,)  # BE decodes pause for this step


def test_ls_routed_by_ls_prefill_not_by_be_prompts() -> None:
    a, b = _inst(0), _inst(1)
    _req("be-wait", False, 8000, 0, a)  # a long BE prompt queued on instance 0
    _req("ls-wait", True, 1500, 0, b)  # an LS prompt queued on instance 1
    cluster = ClusterView([a, b], [], 1e9, 0.0)
    new = ReqState("ls", RequestClass.ONLINE, 0.0, 300, 50, SLO)
    route = _policy().route(new, cluster, 0.0)
    assert route.instance_id == 0
