"""A chunk cut at a layer boundary on one simulated instance (OOCO §3.4.1, `tidal.sim.resume`):
the step that resumes it, a swap that carries it, a recompute or release that drops it, and a
migration refused while it is pending (as the live instance refuses one)."""

from __future__ import annotations

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.plan import StepPlan
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState
from tidal.schemas.enums import RequestClass
from tidal.sim.apply import start_span
from tidal.sim.recorder import Recorder
from tidal.sim.resume import Cuts, layer_ends, layered_step
from tidal.sim.span import finish_span
from tidal.sim.transfers import Transfers

# step = 0.01 + 0.001 * tokens; 1000 B of KV per token over a 1 MB/s copy: 0.001 s per token
LINEAR = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


def cut_prefill(layer: int = 4) -> tuple[InstanceState, dict[str, ReqState], ReqState, Cuts]:
    """An offline request whose first 400-token chunk was cut after `layer` of 10 layers: its
    computed tokens still 0, the chunk's 25 blocks held (what the live engine reports)."""
    inst = InstanceState(0, InstanceRole.RELAXED, 4096, 256, 16, 100, 75, LINEAR, 1000.0, 1e6)
    inst.num_layers = 10
    r = ReqState("a", RequestClass.OFFLINE, 0.0, 990, 5, phase=Phase.RUNNING, instance_id=0)
    r.num_blocks = 25
    inst.running.append(r)
    return inst, {"a": r}, r, {"a": (400, layer)}


def test_the_resuming_step_runs_the_cut_chunk_from_its_layer() -> None:
    inst, reqs, a, cuts = cut_prefill(layer=4)
    rec = Recorder(1, 1.0)
    # the policy asks for 590 tokens; the instance runs the cut 400 (the live executor's rule),
    # its 6 layers left: 0.01 fixed + 0.6 x 0.4 = 0.25 s
    span = start_span(inst, StepPlan(prefill={"a": 590}), reqs, 0.0, rec, cuts)
    assert span.prefill == [(a, 400)]
    assert span.end_s == pytest.approx(0.25)
    assert inst.num_free_blocks == 75  # its blocks were held already
    finish_span(inst, span, span.end_s, rec, cuts)
    assert a.num_computed_tokens == 400 and not cuts


def test_a_batch_beside_a_resumed_chunk_runs_every_layer() -> None:
    # layers 0-3: 100 tokens (0.1 s per 10 layers); layers 4-9: 500 (0.5 s): 0.01 + 0.04 + 0.3
    step_s, fixed, segs = layered_step(LINEAR, [(4, 400, 0), (0, 100, 0)], [], 0, 10)
    assert fixed == pytest.approx(0.01)
    assert step_s == pytest.approx(0.35)
    assert segs == [(0, pytest.approx(0.01)), (4, pytest.approx(0.05))]
    ends = layer_ends(0.01, 0.35, segs, 10)
    assert ends[3] == pytest.approx(0.05) and ends[-1] == pytest.approx(0.35)


def test_a_swap_carries_the_cut_chunk_and_recompute_drops_it() -> None:
    inst, reqs, a, cuts = cut_prefill()
    rec = Recorder(1, 1.0)
    span = start_span(inst, StepPlan(swap_out=("a",)), reqs, 0.0, rec, cuts)
    assert a.phase is Phase.SWAPPED and a.num_blocks == 0 and cuts == {"a": (400, 4)}
    assert span.end_s == pytest.approx(0.41)  # an empty step (0.01) and the chunk's KV copy
    finish_span(inst, span, span.end_s, rec, cuts)
    span = start_span(inst, StepPlan(swap_in=("a",), prefill={"a": 7}), reqs, 1.0, rec, cuts)
    assert a.num_blocks == 25 and span.prefill == [(a, 400)]
    assert span.end_s == pytest.approx(1.0 + 0.4 + 0.25)
    finish_span(inst, span, span.end_s, rec, cuts)
    assert a.num_computed_tokens == 400 and not cuts

    inst, reqs, a, cuts = cut_prefill()
    start_span(inst, StepPlan(recompute=("a",)), reqs, 0.0, rec, cuts)
    assert a.phase is Phase.WAITING and not cuts and inst.num_free_blocks == 100


def test_a_decode_with_a_cut_chunk_is_not_migrated() -> None:
    inst, reqs, a, cuts = cut_prefill()
    other = InstanceState(1, InstanceRole.STRICT, 512, 256, 16, 100, 100, LINEAR, 1000.0, 1e6)
    a.num_computed_tokens, a.num_output_tokens, a.num_blocks = 990, 1, 62
    cuts["a"] = (1, 4)  # its decode was cut
    rec = Recorder(2, 1.0)
    moves = Transfers(
        ClusterView([inst, other], [], 1e9),
        reqs,
        rec,
        0.0,
        xfer_at=lambda t, p: None,
        handoff_at=lambda t, p: None,
        interrupt=lambda i, t, o: None,
        in_step=lambda i: False,
        cuts=cuts,
    )
    moves.migrate("a", 1, 0.0)
    assert rec.num_migrations_refused == 1 and rec.num_migrations == 0
    assert a.phase is Phase.RUNNING and a.instance_id == 0 and a in inst.running
