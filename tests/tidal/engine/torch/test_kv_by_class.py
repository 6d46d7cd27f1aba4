"""Out of KV memory, by class (issue 27 item 3), in the torch and sim engines' own planners:
only offline work is evicted (recompute); an online request is never evicted, and when only
online requests hold KV and nothing can run, the newest ends with an "out of KV memory" error
event, never a silent "length"; the torch engine refuses at `add()` a request that can never fit.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.tidal.engine.sim.test_engine import make_engine as make_sim_engine
from tidal.engine.api import (
    OUT_OF_KV_ERROR,
    EngineRequest,
    FinishReason,
    RequestClass,
    SamplingParams,
    TokenEvent,
)
from tidal.plan import StepPlan

ONLINE, OFFLINE = RequestClass.ONLINE, RequestClass.OFFLINE


def request(rid: str, n: int, max_tokens: int, cls: RequestClass, t: float) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i + 3 * len(rid) + ord(rid[-1])) % 250 + 1 for i in range(n)]
    return EngineRequest(rid, prompt, sp, cls, t)


def drive(engine: Any, max_steps: int = 5000) -> tuple[list[TokenEvent], int]:
    """Step to the end. Returns the final events in the order they came, and how many times
    an online request lost KV it had computed (an eviction: its computed tokens went down)."""
    finals: list[TokenEvent] = []
    online_evictions = 0
    prev: dict[str, int] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return finals, online_evictions
        finals += [ev for ev in engine.step().events if ev.finish_reason is not None]
        engine.check_integrity()
        now = {s.req_id: s for s in engine.snapshot()}
        for rid, s in now.items():
            if s.req_class is ONLINE and s.num_computed_tokens < prev.get(rid, 0):
                online_evictions += 1
        prev = {rid: s.num_computed_tokens for rid, s in now.items()}
    raise AssertionError("the engine never finished")


@pytest.fixture(params=["torch", "sim"])
def engine_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def small_engine(kind: str, make_engine: Any, num_blocks: int) -> Any:
    """block_size 8, `num_blocks` KV blocks, chunks of 16 under a 64-token budget."""
    if kind == "torch":
        return make_engine(
            kv_cache_tokens=8 * num_blocks,
            block_size=8,
            chunk_size=16,
            token_budget=64,
            enable_prefix_cache=False,
        )
    return make_sim_engine(
        num_kv_blocks=num_blocks, block_size=8, max_model_len=64, chunk_size=16, max_batch_tokens=64
    )


def test_kv_full_of_offline_work_never_evicts_an_online_request(
    engine_kind: str, make_engine: Any
) -> None:
    e = small_engine(engine_kind, make_engine, num_blocks=16)
    for i in range(4):  # 4 x 5 blocks (24 + 15 KV tokens each) in a pool of 16
        e.add(request(f"off{i}", 24, 16, OFFLINE, float(i)))
    for _ in range(2):  # the offline prompts are in; their decodes will want more blocks
        e.step()
    assert e.num_free_blocks() < 8  # less than the two online requests will need
    before = e.num_recompute_preemptions
    for i in range(2):
        e.add(request(f"on{i}", 20, 12, ONLINE, 10.0 + i))
    finals, online_evictions = drive(e)
    assert online_evictions == 0
    assert e.num_recompute_preemptions > before  # offline work gave its KV back
    by_id = {ev.req_id: ev for ev in finals}
    assert len(by_id) == 6
    assert [ev.req_id for ev in finals[:2]] == ["on0", "on1"]  # online work runs first
    for rid, ev in by_id.items():
        assert ev.finish_reason is FinishReason.LENGTH and not ev.error
        assert ev.num_output_tokens == (12 if rid.startswith("on") else 16)


def test_only_online_work_and_too_little_kv_ends_the_newest_with_an_error(
    engine_kind: str, make_engine: Any
) -> None:
    e = small_engine(engine_kind, make_engine, num_blocks=8)
    for i, rid in enumerate("abc"):  # each fits alone (5 of 8 blocks), not together
        e.add(request(rid, 16, 24, ONLINE, float(i)))
    finals, online_evictions = drive(e)
    assert online_evictions == 0
    errors = [ev for ev in finals if ev.finish_reason is FinishReason.ERROR]
    assert errors and errors[0].req_id == "c"
    assert all(ev.error == OUT_OF_KV_ERROR and "out of KV memory" in ev.error for ev in errors)
    lengths = [ev for ev in finals if ev.finish_reason is FinishReason.LENGTH]
    assert [ev.req_id for ev in lengths] == ["a"]  # the oldest ran to the end
    assert all(ev.num_output_tokens == 24 for ev in lengths)  # no silent "length" cut short
    assert len(finals) == 3 and e.num_free_blocks() == 8


def test_an_explicit_plan_takes_offline_kv_for_an_online_prefill(make_engine: Any) -> None:
    e = small_engine("torch", make_engine, num_blocks=8)
    e.add(request("off", 48, 8, OFFLINE, 0.0))
    e.step(StepPlan(prefill={"off": 48}))  # 6 of 8 blocks
    e.add(request("on", 24, 4, ONLINE, 1.0))
    res = e.step(StepPlan(prefill={"on": 24}, decode=("off",)))  # on needs 3 blocks, 2 free
    assert res.telemetry.num_requests == 1 and res.telemetry.num_prefill_tokens == 24
    snaps = {s.req_id: s for s in e.snapshot()}
    assert (snaps["off"].status, snaps["off"].num_blocks) == ("waiting", 0)  # recomputed
    assert snaps["on"].num_computed_tokens == 24 and e.num_recompute_preemptions == 1
    e.check_integrity()


def test_torch_add_refuses_a_request_that_can_never_fit_the_kv_pool(make_engine: Any) -> None:
    e = small_engine("torch", make_engine, num_blocks=8)  # 64 KV tokens
    with pytest.raises(ValueError, match=r"max_tokens \(30\) can never fit .* KV cache of 64"):
        e.add(request("big", 40, 30, ONLINE, 0.0))
    assert "big" not in e.seqs
    with pytest.raises(ValueError, match="can never fit"):
        e.add(request("big", 40, 25, ONLINE, 0.0))
    assert e.max_model_len == 64  # the KV pool caps the context (512 in the model's config)
    e.add(request("fits", 40, 24, ONLINE, 0.0))  # 40 + 24 = 64 tokens: the whole pool
    finals, _ = drive(e)
    assert [(ev.finish_reason, ev.num_output_tokens) for ev in finals] == [
        (FinishReason.LENGTH, 24)
    ]
