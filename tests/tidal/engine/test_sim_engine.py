from __future__ import annotations

import pytest

from tidal.engine.api import EngineRequest, FinishReason, RequestClass, SamplingParams
from tidal.engine.sim import LinearStepModel, SimEngine, SimEngineConfig, SimTokenizer
from tidal.perf.api import BatchShape


def make_request(
    req_id: str,
    prompt_len: int = 10,
    max_tokens: int = 3,
    req_class: RequestClass = RequestClass.ONLINE,
) -> EngineRequest:
    return EngineRequest(
        req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), req_class
    )


def make_engine(**kw: int) -> SimEngine:
    model = LinearStepModel(
        base_s=0.01, prefill_token_s=0.001, decode_req_s=0.002, context_token_s=0.0001
    )
    return SimEngine(SimEngineConfig(**kw), model)  # type: ignore[arg-type]


def test_one_request_step_by_step() -> None:
    eng = make_engine(max_batch_tokens=8)
    eng.add(make_request("a", prompt_len=10, max_tokens=3))
    # Step 1: chunk of 8 prompt tokens (budget 8): 0.01 + 8*0.001 = 0.018 s, no token yet.
    r1 = eng.step()
    assert r1.events == []
    assert r1.telemetry.num_prefill_tokens == 8
    assert r1.telemetry.step_s == pytest.approx(0.018)
    # Step 2: the last 2 prompt tokens; finishing the prefill samples token 1.
    r2 = eng.step()
    assert [e.num_output_tokens for e in r2.events] == [1]
    assert r2.telemetry.step_s == pytest.approx(0.01 + 2 * 0.001)
    # Step 3: one decode over 11 KV tokens: 0.01 + 0.002 + 11*0.0001 = 0.0131 s.
    r3 = eng.step()
    assert r3.telemetry.num_decode_tokens == 1
    assert r3.telemetry.num_context_tokens == 11
    assert r3.telemetry.step_s == pytest.approx(0.0131)
    r4 = eng.step()
    assert r4.events[0].finish_reason == FinishReason.LENGTH
    assert r4.events[0].num_output_tokens == 3
    assert not eng.has_work()
    assert eng.load().num_kv_blocks_used == 0


def test_output_is_deterministic_per_prompt() -> None:
    def run() -> str:
        eng = make_engine()
        eng.add(make_request("x", max_tokens=5))
        text = ""
        while eng.has_work():
            text += "".join(e.text for e in eng.step().events)
        return text

    assert run() == run()
    assert len(run().split()) == 5


def test_online_requests_are_admitted_before_waiting_offline_ones() -> None:
    eng = make_engine(max_num_seqs=1)
    eng.add(make_request("off", req_class=RequestClass.OFFLINE))
    eng.add(make_request("on"))
    eng.step()
    assert list(eng.scheduler.running) == ["on"]
    assert eng.load().num_offline == 1 and eng.load().num_online == 1


def test_abort_frees_kv_and_unknown_ids_report_false() -> None:
    eng = make_engine()
    eng.add(make_request("a", prompt_len=100, max_tokens=50))
    eng.step()
    assert eng.load().num_kv_blocks_used == 10  # ceil(150 / 16) blocks reserved
    assert eng.abort("a")
    assert eng.load().num_kv_blocks_used == 0
    assert not eng.abort("a")


def test_rejects_requests_that_can_never_fit() -> None:
    eng = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        eng.add(make_request("big", prompt_len=60, max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        eng.add(make_request("empty", prompt_len=0))


def test_kv_pool_limits_admission_without_losing_requests() -> None:
    eng = make_engine(num_kv_blocks=16, block_size=16, max_model_len=256)
    for i in range(5):  # each needs ceil((100+28)/16) = 8 blocks: two fit at once
        eng.add(make_request(f"r{i}", prompt_len=100, max_tokens=28))
    finished = set()
    max_running = 0
    while eng.has_work():
        for e in eng.step().events:
            if e.finish_reason is not None:
                finished.add(e.req_id)
        max_running = max(max_running, len(eng.scheduler.running))
        assert eng.load().num_kv_blocks_used <= 16
    assert finished == {f"r{i}" for i in range(5)}
    assert max_running == 2


def test_zero_batch_costs_nothing_and_config_is_checked() -> None:
    assert LinearStepModel().step_s(BatchShape()) == 0.0
    with pytest.raises(ValueError):
        LinearStepModel(base_s=-1)
    with pytest.raises(ValueError, match="cannot hold"):
        SimEngineConfig(max_model_len=1000, num_kv_blocks=10, block_size=16)


def test_tokenizer_round_trips_text() -> None:
    tok = SimTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|assistant|>")
