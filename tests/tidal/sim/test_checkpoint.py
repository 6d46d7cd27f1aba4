"""Offline KV checkpoints in the simulator (issue 39 item 3, ConServe): the stages' costs on one
instance (checkpoint beside the step, release with no copy, restore by swap_in), the budget, and
a whole run of the `aggregated` policy with `checkpoint_offline` against recompute."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tidal.sim.test_core import OFF, make_policy_for, make_setup, req
from tidal.config.cluster import load_config
from tidal.perf.linear import LinearStepModel
from tidal.plan import PlanRefused, RefusalReason, StepPlan
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState
from tidal.sim.apply import start_span
from tidal.sim.build import simulate
from tidal.sim.core import Simulator
from tidal.sim.metrics import summarize
from tidal.sim.recorder import Recorder
from tidal.sim.span import finish_span

# step = 0.01 + 0.001 * tokens; 1000 B of KV per token over a 1 MB/s copy: 0.001 s per token
LINEAR = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0, per_attn_pair_s=0.0)
AGG = (InstanceRole.AGGREGATED,)
ROOT = Path(__file__).resolve().parents[3]


def decoding(ckpt_tokens: int) -> tuple[InstanceState, dict[str, ReqState], ReqState]:
    """One offline request decoding with 41 tokens of KV (3 blocks of 16) on 100 blocks."""
    inst = InstanceState(0, InstanceRole.AGGREGATED, 512, 256, 16, 100, 97, LINEAR, 1000.0, 1e6)
    inst.ckpt_capacity_tokens = ckpt_tokens
    r = ReqState("a", OFF, 0.0, 40, 100, phase=Phase.RUNNING, instance_id=0)
    r.num_computed_tokens, r.num_output_tokens, r.num_blocks = 40, 1, 3
    inst.running.append(r)
    return inst, {"a": r}, r


def test_checkpoint_release_and_restore_cost_what_they_copy() -> None:
    inst, reqs, a = decoding(ckpt_tokens=64)
    rec = Recorder(1, 1.0)
    # 32 tokens (2 full blocks) copied beside a 0.011 s decode: the copy's 0.032 s is the step
    span = start_span(inst, StepPlan(decode=("a",), checkpoint=("a",)), reqs, 0.0, rec)
    assert span.end_s == pytest.approx(0.032)
    finish_span(inst, span, span.end_s, rec)
    assert a.num_checkpointed_tokens == inst.ckpt_tokens == rec.num_checkpoint_tokens == 32
    assert a.num_computed_tokens == 41

    # release: blocks back at once, nothing copied (an empty step of 0.01 s), 9 tokens lost
    span = start_span(inst, StepPlan(release=("a",)), reqs, 1.0, rec)
    assert span.end_s == pytest.approx(1.01)
    assert inst.num_free_blocks == 100 and a.phase is Phase.SWAPPED and a in inst.swapped
    assert a.num_computed_tokens == 32 and rec.num_checkpoint_lost_tokens == 9
    assert a.num_prefill_left == 9  # the lost tokens; the last output token feeds a decode

    # restore: 32 tokens copied back (0.032 s) before a 9-token prefill (0.019 s)
    plan = StepPlan(swap_in=("a",), prefill={"a": 9})
    span = start_span(inst, plan, reqs, 2.0, rec)
    assert span.end_s == pytest.approx(2.051)
    finish_span(inst, span, span.end_s, rec)
    assert a.is_decoding and a.num_computed_tokens == 41 and rec.num_restored_tokens == 32
    assert inst.ckpt_tokens == 32  # the checkpoint stays while the request lives


def test_the_budget_and_the_capability_refuse_typed() -> None:
    inst, reqs, a = decoding(ckpt_tokens=16)  # one block
    rec = Recorder(1, 1.0)
    with pytest.raises(PlanRefused) as err:  # two new full blocks, room for one
        start_span(inst, StepPlan(checkpoint=("a",)), reqs, 0.0, rec)
    assert err.value.reason is RefusalReason.HOST_MEMORY_FULL
    assert inst.ckpt_tokens == 0 and a.num_checkpointed_tokens == 0
    with pytest.raises(PlanRefused) as err:  # no checkpoint: nothing to release with
        start_span(inst, StepPlan(release=("a",)), reqs, 0.0, rec)
    assert err.value.reason is RefusalReason.WRONG_STATE and a.phase is Phase.RUNNING
    inst, reqs, a = decoding(ckpt_tokens=0)  # no checkpoint memory: no capability
    with pytest.raises(PlanRefused) as err:
        start_span(inst, StepPlan(checkpoint=("a",)), reqs, 0.0, rec)
    assert err.value.reason is RefusalReason.NO_KV_CHECKPOINT


def run(checkpoint: bool) -> Recorder:
    # 40 blocks of 16 = 640 tokens for 4 offline requests that end at 300 tokens each: KV runs
    # out and the latest arrivals are preempted, again and again
    setup = make_setup(num_blocks=40, ckpt_capacity_tokens=4096 if checkpoint else 0)
    pol = make_policy_for("aggregated", AGG, checkpoint_offline=checkpoint)
    sim = Simulator([setup], pol, check=True)  # invariants (checkpoint memory too) every event
    return sim.run([req(f"o{i}", 0.01 * i, 100, 200, OFF) for i in range(4)])


def test_a_run_with_checkpoints_recomputes_only_tails() -> None:
    base, ckpt = run(False), run(True)
    for rec in (base, ckpt):
        assert all(r.phase is Phase.FINISHED and r.num_output_tokens == 200 for r in rec.requests)
    assert base.num_preemptions > 0 and base.num_releases == 0
    assert ckpt.num_releases > 0 and ckpt.num_restored_tokens > 0
    # each release loses under two blocks (checkpointed at least once a block)
    assert ckpt.num_checkpoint_lost_tokens < 2 * 16 * ckpt.num_releases
    assert ckpt.num_checkpoint_lost_tokens + ckpt.num_recompute_lost_tokens < (
        base.num_recompute_lost_tokens / 4
    )


def ooco_run(checkpoint_gb: float) -> Recorder:
    on = "true" if checkpoint_gb else "false"
    cfg = load_config(
        ROOT / "configs/ooco.yaml",
        (
            "duration_s=30",
            "drain_s=120",
            "kv_capacity_tokens=8000",  # small: offline decodes are preempted often
            "offline.rate=2",
            f"checkpoint_host_gb={checkpoint_gb}",
            f"policies.aggregated.checkpoint_offline={on}",
        ),
    )
    return simulate(cfg, "aggregated", check=True)


def test_a_cluster_config_turns_checkpoints_on() -> None:
    base, ckpt = ooco_run(0.0), ooco_run(50.0)
    assert all(r.finish_s is not None for rec in (base, ckpt) for r in rec.requests)
    assert base.num_releases == 0 and ckpt.num_releases > 0
    lost = ckpt.num_recompute_lost_tokens + ckpt.num_checkpoint_lost_tokens
    assert lost < base.num_recompute_lost_tokens / 2
    counters = summarize(ckpt, 30.0, "aggregated", "ooco")["counters"]  # in summary.json
    assert counters["releases"] == ckpt.num_releases
    assert counters["checkpoint_lost_tokens"] == ckpt.num_checkpoint_lost_tokens
    with pytest.raises(ValueError, match="checkpoint_host_gb must be >= 0"):
        load_config(ROOT / "configs/ooco.yaml", ("checkpoint_host_gb=-1",))
