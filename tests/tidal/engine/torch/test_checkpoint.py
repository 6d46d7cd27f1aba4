"""Offline KV checkpointed to host memory (ConServe) on the torch engine with SmolLM2-135M:
checkpoint while decoding (copied in the background, `wait_checkpoints` waits for it), release
(GPU blocks freed at once), restore by `swap_in`; greedy output equals an uninterrupted run,
recomputing nothing when every computed token was checkpointed and only the tail past the last
checkpointed block when not. The host budget bounds the checkpoints; an engine without the
capability refuses the plan, typed. The engine's own planner checkpoints offline requests
itself, and its eviction releases them instead of recomputing them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tidal.engine.api import EngineRequest, RequestClass, SamplingParams
from tidal.engine.executor import execute
from tidal.engine.torch.engine import TorchEngine
from tidal.engine.torch.engine_config import EngineConfig
from tidal.plan import PlanRefused, RefusalReason, StepPlan

BS = 16
SP = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
Factory = Callable[..., TorchEngine]


@pytest.fixture(scope="module")
def smollm2() -> TorchEngine:
    from tidal.engine.torch.loader import load_torch_engine

    return load_torch_engine(None, dtype="float32", kv_cache_tokens=256, block_size=BS)


@pytest.fixture
def make(smollm2: TorchEngine) -> Factory:
    """Engines sharing SmolLM2's weights, each with its own KV pool."""

    def make(**kw: Any) -> TorchEngine:
        cfg = EngineConfig(**({"kv_cache_tokens": 256, "block_size": BS} | kw))
        return TorchEngine(smollm2.model, smollm2.tokenizer, smollm2.model_name, cfg)

    return make


def prompt(e: TorchEngine) -> list[int]:
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    return e.tokenizer.encode(text)


def add(e: TorchEngine, rid: str = "r", cls: RequestClass = RequestClass.OFFLINE) -> None:
    e.add(EngineRequest(rid, prompt(e), SP, cls))


def run_alone(make: Factory) -> list[int]:
    e = make()
    add(e)
    out: list[int] = []
    while e.has_work():
        out += [t for ev in e.step().events for t in ev.token_ids]
    return out


def decode_until(e: TorchEngine, out: list[int], done: Callable[[], bool], ckpt: bool) -> None:
    """Decode `r` (checkpointing before every step when `ckpt`) until `done()`."""
    while not done():
        assert "r" in e.seqs, "it finished first: give it more max_tokens"
        plan = StepPlan(decode=("r",), checkpoint=("r",) if ckpt else ())
        res = execute(e, plan).result
        assert res is not None
        out += [t for ev in res.events for t in ev.token_ids]
        e.check_integrity()


def finish(e: TorchEngine, out: list[int]) -> None:
    while e.has_work():  # the engine's own planner: the lost tail prefills, then decodes
        out += [t for ev in e.step().events for t in ev.token_ids]
        e.check_integrity()


def test_fully_checkpointed_release_and_restore_recompute_nothing(make: Factory) -> None:
    ref = run_alone(make)
    e = make(checkpoint_host_bytes=1 << 24)
    add(e)
    out = [t for ev in e.step().events for t in ev.token_ids]  # prefill, first token
    seq = e.seqs["r"]
    decode_until(e, out, lambda: seq.num_computed % BS == 0 and seq.num_computed > 2 * BS, True)
    execute(e, StepPlan(checkpoint=("r",)))  # the block the last step filled: queued
    n = seq.num_computed
    assert e.config.checkpoint_background and seq.num_ckpt_queued == n
    e.wait_checkpoints()
    assert seq.num_ckpt_tokens == n and not seq.ckpt_jobs
    assert e.num_checkpoint_bytes == int(n * e.kv_bytes_per_token)

    execute(e, StepPlan(release=("r",)))
    assert e.allocator.num_free == e.num_kv_blocks  # every GPU block back at once
    assert e.snapshot()[0].status == "swapped" and e.num_checkpoint_lost_tokens == 0
    assert e.last_release_s is not None
    e.check_integrity()

    execute(e, StepPlan(swap_in=("r",)))
    assert e.num_restored_tokens == n and seq.num_pending == 1  # it decodes at once
    finish(e, out)
    assert out == ref
    assert e.num_recompute_preemptions == 0 and e.num_checkpoint_bytes == 0  # freed at the end


def test_the_tail_past_the_checkpoint_is_all_that_is_recomputed(make: Factory) -> None:
    ref = run_alone(make)
    e = make(checkpoint_host_bytes=1 << 24)
    add(e)
    out = [t for ev in e.step().events for t in ev.token_ids]
    seq = e.seqs["r"]
    decode_until(e, out, lambda: seq.num_computed % BS == 5, True)  # 5 into a block
    e.wait_checkpoints()
    kept = seq.num_ckpt_tokens
    assert kept == seq.num_computed - 5
    execute(e, StepPlan(release=("r",)))
    assert e.num_checkpoint_lost_tokens == 5
    execute(e, StepPlan(swap_in=("r",)))
    assert seq.num_computed == kept and seq.num_pending == 6  # 5 lost + the last token
    finish(e, out)
    assert out == ref


def test_released_twice_copies_no_block_twice(make: Factory) -> None:
    e = make(checkpoint_host_bytes=1 << 24)
    add(e)
    e.step()
    seq = e.seqs["r"]
    decode_until(e, [], lambda: seq.num_computed >= 2 * BS + 3, True)
    e.wait_checkpoints()
    execute(e, StepPlan(release=("r",)))
    execute(e, StepPlan(swap_in=("r",)))
    used, copied = e.num_checkpoint_bytes, e.num_checkpoint_copied_tokens
    execute(e, StepPlan(checkpoint=("r",)))  # nothing new is full: nothing copied
    assert e.num_checkpoint_bytes == used and len(seq.ckpt) > 0 and not seq.ckpt_jobs
    execute(e, StepPlan(release=("r",)))
    assert e.num_checkpoint_bytes == used and e.num_checkpoint_copied_tokens == copied == 2 * BS
    e.check_integrity()


def test_the_host_budget_bounds_the_checkpoints(make: Factory) -> None:
    probe = make()
    budget = int(2 * BS * probe.kv_bytes_per_token)  # two blocks
    e = make(checkpoint_host_bytes=budget)
    add(e)
    e.step()
    seq = e.seqs["r"]
    decode_until(e, [], lambda: seq.num_computed >= 3 * BS, False)
    with pytest.raises(PlanRefused) as err:
        execute(e, StepPlan(checkpoint=("r",)))
    assert err.value.reason is RefusalReason.HOST_MEMORY_FULL
    assert e.num_checkpoint_bytes == 0 and not seq.ckpt and e.checkpoint_room_bytes == budget
    with pytest.raises(PlanRefused) as err:  # nothing to free with: refused, still running
        execute(e, StepPlan(release=("r",)))
    assert err.value.reason is RefusalReason.WRONG_STATE and seq.block_ids
    e.check_integrity()


def test_without_the_capability_or_for_online_work_the_plan_is_refused(make: Factory) -> None:
    e = make()  # checkpoint_host_bytes 0: no checkpoints
    assert not e.capabilities.kv_checkpoint
    add(e)
    e.step()
    for plan in (StepPlan(checkpoint=("r",)), StepPlan(release=("r",))):
        with pytest.raises(PlanRefused) as err:
            execute(e, plan)
        assert err.value.reason is RefusalReason.NO_KV_CHECKPOINT
    on = make(checkpoint_host_bytes=1 << 20)
    add(on, "o", RequestClass.ONLINE)
    on.step()
    for plan in (StepPlan(checkpoint=("o",)), StepPlan(release=("o",))):
        with pytest.raises(PlanRefused) as err:
            execute(on, plan)
        assert err.value.reason is RefusalReason.ONLINE_EVICTION
    with pytest.raises(ValueError, match="checkpoint_host_bytes must be >= 0"):
        EngineConfig(checkpoint_host_bytes=-1)


# ---- the engine's own planner (no policy plan) ---------------------------------------------
LONG = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def own_eviction(make: Factory, budget: int) -> tuple[TorchEngine, list[int]]:
    """An offline request decodes under the own planner until it holds 3 blocks of a 6-block
    pool; an online request whose prompt needs 4 then arrives; both run to the end."""
    e = make(kv_cache_tokens=6 * BS, checkpoint_host_bytes=budget)
    add(e, "r")
    seq = e.seqs["r"]
    out: list[int] = []
    while seq.num_computed < 2 * BS + 4:
        out += [t for ev in e.step().events for t in ev.token_ids]
        e.check_integrity()
    e.wait_checkpoints()  # (a copy still under way would be waited for by the release)
    text = "Tell me everything you know about lighthouses, their keepers and their lamps. " * 5
    e.add(EngineRequest("on", e.tokenizer.encode(text)[: 3 * BS + 8], LONG, RequestClass.ONLINE))
    first = e.step()  # the online prefill takes the offline request's blocks
    out += [t for ev in first.events if ev.req_id == "r" for t in ev.token_ids]
    assert e.seqs["on"].block_ids, "the online request was not admitted"
    e.check_integrity()
    while e.has_work():
        out += [t for ev in e.step().events if ev.req_id == "r" for t in ev.token_ids]
        e.check_integrity()
    return e, out


def test_the_own_eviction_releases_a_checkpointed_request(make: Factory) -> None:
    ref = run_alone(make)
    e, out = own_eviction(make, 1 << 24)
    assert e.num_checkpoint_releases == 1 and e.num_recompute_preemptions == 0
    assert e.num_checkpoint_lost_tokens == 4  # the tail past its 2 full blocks, no more
    assert e.num_restored_tokens == 2 * BS  # restored by the own planner once KV was free
    assert out == ref
    assert e.num_checkpoint_bytes == 0 and e.allocator.num_free == e.num_kv_blocks

    bare, out = own_eviction(make, 0)  # no checkpoints: the same eviction is a recompute
    assert bare.num_recompute_preemptions == 1 and bare.num_checkpoint_releases == 0
    assert out == ref


def test_the_own_planner_checkpoints_up_to_the_budget_then_stops(make: Factory) -> None:
    probe = make()
    budget = int(2 * BS * probe.kv_bytes_per_token)  # two blocks
    ref = run_alone(make)
    e = make(checkpoint_host_bytes=budget)
    add(e)
    seq = e.seqs["r"]
    out: list[int] = []
    while "r" in e.seqs:
        before = seq.num_computed  # the step queues the blocks full before it computes
        out += [t for ev in e.step().events for t in ev.token_ids]
        e.check_integrity()
        if "r" in e.seqs:
            assert seq.num_ckpt_queued == min(before // BS * BS, 2 * BS)  # as many as fit
            assert e.num_checkpoint_bytes == int(seq.num_ckpt_queued * e.kv_bytes_per_token)
    assert seq.num_computed > 3 * BS  # it went on decoding well past the budget
    assert e.num_checkpoint_copied_tokens == 2 * BS  # and no more was copied
    assert out == ref and e.num_checkpoint_bytes == 0
