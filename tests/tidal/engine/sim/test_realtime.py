"""A realtime sim engine waits its emulated step time and is cut at layer boundaries from
another thread, like the torch engine."""

from __future__ import annotations

import threading
import time

import pytest

from tests.tidal.engine.sim.test_control import reference
from tests.tidal.engine.sim.test_engine import make_engine, make_request, run_to_end
from tidal.engine.sim.engine import SimEngine, SimEngineConfig
from tidal.perf.linear import LinearStepModel
from tidal.plan import StepPlan

STEP_S = 0.2  # every non-empty step: 10 layers of 20 ms
LAYER_S = STEP_S / 10


def make_realtime_engine() -> SimEngine:
    model = LinearStepModel(STEP_S, 0.0, 0.0, 0.0, 0.0)
    return SimEngine(SimEngineConfig(tokenizer="bytes", num_layers=10, realtime=True), model)


def preempt_after(eng: SimEngine, delay_s: float) -> threading.Thread:
    def signal() -> None:
        time.sleep(delay_s)
        assert eng.request_layer_cut()

    t = threading.Thread(target=signal)
    t.start()
    return t


def test_step_waits_its_emulated_time() -> None:
    eng = make_realtime_engine()
    assert not eng.request_layer_cut()  # no step running
    eng.add(make_request("a", prompt_len=20, max_tokens=8))
    t0 = time.perf_counter()
    res = eng.step()
    assert time.perf_counter() - t0 == pytest.approx(STEP_S, abs=0.05)
    assert res.telemetry.step_s == pytest.approx(STEP_S)
    assert not eng.last_step_preempted


def test_preemption_from_another_thread_cuts_at_the_next_layer_and_resumes() -> None:
    eng = make_realtime_engine()
    eng.add(make_request("a", prompt_len=20, max_tokens=8))
    t = preempt_after(eng, 0.05)
    t0 = time.perf_counter()
    res = eng.step(StepPlan(prefill={"a": 20}))
    elapsed = time.perf_counter() - t0
    t.join()
    # signalled at 50 ms inside layer 3 (40-60 ms): the step ends when that layer does
    assert res.events == [] and eng.last_step_preempted
    # NOTE: wall time is only bounded below (a sleep never ends early; on a loaded machine it
    # ends late): the emulated step_s below says which layers ran
    assert elapsed >= 0.05
    assert eng.last_preempt_latency_s is not None and eng.last_preempt_latency_s < LAYER_S + 0.02
    assert res.telemetry.step_s == pytest.approx(3 * LAYER_S)  # emulated: the layers run
    (snap,) = eng.snapshot()
    assert (snap.forced_tokens, snap.num_computed_tokens, snap.num_blocks) == (20, 0, 2)
    with pytest.raises(ValueError, match="resume"):
        eng.step(StepPlan(prefill={"a": 10}))
    t0 = time.perf_counter()
    res = eng.step(StepPlan(prefill={"a": 20}))
    elapsed = time.perf_counter() - t0
    assert [e.num_output_tokens for e in res.events] == [1] and not eng.last_step_preempted
    assert elapsed >= 7 * LAYER_S - 0.005  # it waited out the 7 layers left ...
    assert res.telemetry.step_s == pytest.approx(7 * LAYER_S)  # ... and only those
    out = [t for e in res.events for t in e.token_ids]
    fast = make_engine()  # finish without waiting: migrate to a non-realtime engine
    fast.import_request(eng.export_request("a"))
    assert out + run_to_end(fast)["a"] == reference()


def test_a_cut_decode_keeps_its_layers_too() -> None:
    eng = make_realtime_engine()
    eng.add(make_request("a", prompt_len=20, max_tokens=8))
    eng.step()
    t = preempt_after(eng, 0.03)
    assert eng.step(StepPlan(decode=("a",))).events == []
    t.join()
    (snap,) = eng.snapshot()
    assert (snap.forced_tokens, snap.num_computed_tokens, snap.num_output_tokens) == (1, 20, 1)
    res = eng.step(StepPlan(decode=("a",)))
    assert [e.num_output_tokens for e in res.events] == [2]
