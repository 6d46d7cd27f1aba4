"""OOCO §3.4.1 layer-level preemption: an online arrival cuts a preemptible offline step, and the
cut chunk keeps its finished layers and resumes from there, as both engines do."""

from __future__ import annotations

import pytest

from tidal.perf.api import BatchShape
from tidal.perf.factory import make_step_model
from tidal.perf.linear import LinearStepModel
from tidal.policy.base import Policy, StepPlan
from tidal.policy.state import InstanceRole, InstanceState, ReqState
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.sim.resume import fixed_s
from tidal.workload.mix import SimRequest

LINEAR = LinearStepModel(base_s=0.01, per_token_s=0.001, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


class OnlineFirstPrefill(Policy):
    """Prefill chunks of at most `chunk` tokens, online first; offline steps are preemptible.
    Decodes go with the prefill chunk (offline ones only when no online prefill waits)."""

    def __init__(
        self, chunk: int = 1 << 20, recompute_cut: bool = False, whole_after_online: bool = False
    ) -> None:
        self.chunk = chunk
        self.whole_after_online = whole_after_online  # once an online one came: whole prompts
        self.online_seen = False
        self.recompute_cut = recompute_cut  # recompute the offline request an online one cut
        self.seen: list[tuple[float, int, int]] = []  # (now, off's computed tokens, blocks)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        todo = [r for r in inst.running if r.num_prefill_left > 0] + inst.waiting
        dec = tuple(r.req_id for r in inst.running if r.is_decoding)
        online = [r for r in todo if r.is_online]
        off = [r for r in (*inst.running, *inst.waiting) if not r.is_online]
        if off:
            self.seen.append((now, off[0].num_computed_tokens, off[0].num_blocks))
        if online:
            self.online_seen = True
            r = online[0]
            evict = ()
            if self.recompute_cut:
                evict = tuple(o.req_id for o in inst.running if not o.is_online)
            return StepPlan(
                prefill={r.req_id: min(self.chunk, r.num_prefill_left)}, recompute=evict
            )
        if todo:
            r = todo[0]
            n = min(self.chunk, r.num_prefill_left)
            if self.whole_after_online and self.online_seen:
                n = r.num_prefill_left
            return StepPlan(prefill={r.req_id: n}, decode=dec, layer_cut=True)
        return StepPlan(decode=dec, layer_cut=True) if dec else StepPlan()


def _sim(policy: OnlineFirstPrefill, model: object = LINEAR, chunk: int = 4096) -> Simulator:
    setup = InstanceSetup(InstanceRole.RELAXED, chunk, 200, model, 1.0, num_layers=10)  # type: ignore[arg-type]
    return Simulator([setup], policy, check=True)


def _by_id(reqs: list[ReqState]) -> dict[str, ReqState]:
    return {r.req_id: r for r in reqs}


def test_online_arrival_cuts_offline_step_at_next_layer_and_the_chunk_resumes() -> None:
    policy = OnlineFirstPrefill()
    sim = _sim(policy)
    rec = sim.run(
        [
            SimRequest("off", RequestClass.OFFLINE, 0.0, 990, 1),
            SimRequest("on", RequestClass.ONLINE, 0.25, 90, 1),
        ]
    )
    by = _by_id(rec.requests)
    # off's step: 0.01 s fixed, then 10 layers of 0.099 s (to 1.0 s); "on" arrives at 0.25,
    # in the third layer, so the step stops at 0.01 + 3 x 0.099 = 0.307; on's prefill
    # 0.01 + 0.09 -> 0.407; off resumes at layer 3: 0.01 + 7 x 0.099 -> 1.11.
    assert by["on"].first_token_s == pytest.approx(0.407)
    assert by["off"].first_token_s == pytest.approx(1.11)
    assert rec.num_layer_preemptions == 1
    assert rec.num_layer_cut_tokens == 990
    busy = sum(sum(b) for b in rec.busy_s)
    assert busy == pytest.approx(0.307 + 0.1 + 0.703)
    # What the policy saw at the online step, right after the cut: off's computed tokens as
    # before the cut and the chunk's KV blocks still held (what the live engine reports).
    seen = {round(t, 6): (c, b) for t, c, b in policy.seen}
    assert seen[0.307] == (0, 62)  # ceil(990 / 16) blocks
    assert not sim.cuts


def test_cut_then_resumed_prefill_costs_uncut_plus_one_step_overhead() -> None:
    """The roofline of the OOCO config's model: a 2,048-token offline chunk cut by an online
    arrival and resumed takes its uncut step time plus one step's fixed part."""
    model = make_step_model("qwen2.5-7b", "a100-80gb", kind="roofline")
    reqs_off = [SimRequest("off", RequestClass.OFFLINE, 0.0, 2048, 1)]
    solo = _sim(OnlineFirstPrefill(), model).run(reqs_off)
    uncut = sum(sum(b) for b in solo.busy_s)
    shape = BatchShape(2048, 1, 2048 * 2048, prefill_sq_tokens=2048 * 2048)
    assert uncut == pytest.approx(model.step_s(shape))
    online = [SimRequest("on", RequestClass.ONLINE, uncut * 0.45, 64, 1)]
    rec = _sim(OnlineFirstPrefill(), model).run(reqs_off + online)
    on_shape = BatchShape(64, 1, 64 * 64, prefill_sq_tokens=64 * 64)
    off_busy = sum(sum(b) for b in rec.busy_s) - model.step_s(on_shape)
    assert rec.num_layer_preemptions == 1
    assert off_busy == pytest.approx(uncut + fixed_s(model, shape), rel=1e-9)
    assert fixed_s(model, shape) > 0


def test_chunked_prefill_cut_mid_prompt_loses_no_tokens() -> None:
    """A prompt in 400-token chunks, its second chunk cut; after the cut the policy asks for
    the whole rest (590), the instance runs the cut chunk of 400 (as the live executor does),
    then the rest; every token comes out once."""
    policy = OnlineFirstPrefill(chunk=400, whole_after_online=True)
    sim = _sim(policy, chunk=400)
    rec = sim.run(
        [
            SimRequest("off", RequestClass.OFFLINE, 0.0, 990, 5),
            SimRequest("on", RequestClass.ONLINE, 0.5, 90, 3),
        ]
    )
    by = _by_id(rec.requests)
    off, on = by["off"], by["on"]
    assert rec.num_layer_preemptions == 1 and rec.num_layer_cut_tokens == 400
    assert off.num_output_tokens == 5 and on.num_output_tokens == 3
    assert off.num_computed_tokens == 990 + 4 and on.num_computed_tokens == 90 + 2
    assert off.finish_s is not None and on.finish_s is not None
    assert sum(rec.offline_tokens) == 5 and sum(rec.online_tokens) == 3
    assert not sim.cuts
    computed = [c for _, c, _ in policy.seen]
    assert computed[:4] == [0, 400, 400, 400]  # before, after chunk 1, at the cut, ...
    assert 800 in computed and computed.index(800) < computed.index(990)


def test_recompute_drops_the_cut_chunk() -> None:
    """A request recomputed after its step was cut starts again from token 0: its cut chunk
    goes with its KV, and the step that prefills it again costs the whole step."""
    sim = _sim(OnlineFirstPrefill(recompute_cut=True))
    rec = sim.run(
        [
            SimRequest("off", RequestClass.OFFLINE, 0.0, 990, 1),
            SimRequest("on", RequestClass.ONLINE, 0.25, 90, 1),
        ]
    )
    by = _by_id(rec.requests)
    assert rec.num_preemptions == 1
    assert by["off"].first_token_s == pytest.approx(0.407 + 1.0)
    assert by["off"].num_output_tokens == 1
    assert not sim.cuts


def test_offline_arrival_does_not_cut() -> None:
    sim = _sim(OnlineFirstPrefill())
    rec = sim.run(
        [
            SimRequest("a", RequestClass.OFFLINE, 0.0, 990, 1),
            SimRequest("b", RequestClass.OFFLINE, 0.25, 90, 1),
        ]
    )
    a, b = sorted(rec.requests, key=lambda r: r.req_id)
    assert a.first_token_s == pytest.approx(1.0)
    assert b.first_token_s == pytest.approx(1.1)
    assert rec.num_layer_preemptions == 0
