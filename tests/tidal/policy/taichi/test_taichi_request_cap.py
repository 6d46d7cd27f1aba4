"""TaiChi's steps and Alg. 2 under the step's request cap (`max_batch_reqs`, vLLM's max_num_seqs,
papers/taichi.md §3.5): a prompt takes a slot too, so decodes that fill the cap leave no room to
prefill, and Alg. 2 (§3.4) does not count such an instance as feasible."""

from __future__ import annotations

from tidal.perf.api import BatchShape
from tidal.perf.linear import LinearStepModel
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState, RequestClass
from tidal.policy.taichi import PrefillTarget, route_prefill
from tidal.policy.taichi.policy import chunked_prefill_step

TOK = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)
CAP = 4


def _inst(num_decodes: int) -> InstanceState:
    inst = InstanceState(0, InstanceRole.D_HEAVY, 512, CAP, 16, 1000, 1000, TOK, 1, 1e9)
    for k in range(num_decodes):  # prompt 20, 5 tokens out: 24 computed, 2 blocks held
        r = ReqState(f"d{k}", RequestClass.ONLINE, 0.0, 20, 100)
        r.phase, r.instance_id, r.num_blocks = Phase.RUNNING, 0, 2
        r.num_output_tokens, r.num_computed_tokens = 5, 24
        inst.running.append(r)
    inst.num_free_blocks -= 2 * num_decodes
    inst.waiting = [ReqState("new", RequestClass.ONLINE, 0.0, 100, 10)]
    return inst


def test_decodes_at_the_cap_leave_no_slot_for_a_prompt() -> None:
    plan = chunked_prefill_step(_inst(CAP))
    assert len(plan.decode) == CAP
    assert plan.prefill == {}  # 512 chunk tokens left, but no request slot


def test_a_free_slot_takes_the_prompt() -> None:
    plan = chunked_prefill_step(_inst(CAP - 1))
    assert len(plan.decode) == CAP - 1
    assert plan.prefill == {"new": 100}


def test_decodes_past_the_cap_run_the_oldest_and_still_no_prompt() -> None:
    plan = chunked_prefill_step(_inst(CAP + 2))
    assert plan.decode == ("d0", "d1", "d2", "d3")
    assert plan.prefill == {}


def test_alg2_skips_an_instance_whose_decodes_fill_the_cap() -> None:
    # The D-heavy instance has the emptier queue, so Alg. 2 would degrade the short prompt there,
    # and its chunk of 512 has room beside 256 decodes -- but not a request slot.
    p = PrefillTarget(
        0, True, 1024, [500], BatchShape(num_decode_reqs=10, decode_context_tokens=1000), TOK, 256
    )
    full = BatchShape(num_decode_reqs=256, decode_context_tokens=25_600)
    d_full = PrefillTarget(1, False, 512, [], full, TOK, 256)
    assert not d_full.can_prefill
    assert route_prefill(200, [p, d_full], 3.0, 0.01) == 0
    d_room = PrefillTarget(
        1, False, 512, [], BatchShape(num_decode_reqs=255, decode_context_tokens=25_500), TOK, 256
    )
    assert route_prefill(200, [p, d_room], 3.0, 0.01) == 1
