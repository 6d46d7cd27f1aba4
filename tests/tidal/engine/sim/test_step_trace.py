"""A realtime sim engine writes each step's wall timings to `step_trace` (`tidal bench replay`
reads them to say where live time went against the emulated time)."""

from __future__ import annotations

import io
import json
import time

from tests.tidal.engine.sim.test_engine import make_request
from tidal.engine.sim.engine import SimEngine, SimEngineConfig
from tidal.perf.linear import LinearStepModel

STEP_S = 0.02  # every step


def test_each_realtime_step_writes_one_line_with_its_timings() -> None:
    model = LinearStepModel(STEP_S, 0.0, 0.0, 0.0, 0.0)
    eng = SimEngine(SimEngineConfig(tokenizer="bytes", num_layers=4, realtime=True), model)
    eng.step_trace = io.StringIO()
    eng.add(make_request("a", prompt_len=20, max_tokens=3))
    eng.step_origin = time.perf_counter() - 0.005  # the caller's 5 ms of host work
    eng.step()  # the prefill
    eng.step()  # a decode
    every = [json.loads(x) for x in eng.step_trace.getvalue().splitlines()]
    lines = [x for x in every if "emulated_s" in x]  # the steps (beside request events)
    assert len(lines) == 2
    first, second = lines
    assert first["num_prefill_tokens"] == 20 and first["num_decode_tokens"] == 0
    assert second["num_prefill_tokens"] == 0 and second["num_decode_tokens"] == 1
    for rec in lines:
        assert rec["emulated_s"] == STEP_S
        assert rec["wall_s"] >= STEP_S and rec["late_s"] >= 0.0
    # the 5 ms before the call are host work inside the step, not added to it
    assert first["host_s"] >= 0.005
    assert first["wall_s"] < STEP_S + first["late_s"] + 1e-3


def test_no_trace_by_default() -> None:
    eng = SimEngine(
        SimEngineConfig(tokenizer="bytes", realtime=True), LinearStepModel(0.001, 0, 0, 0, 0)
    )
    eng.add(make_request("a", prompt_len=4, max_tokens=1))
    eng.step()
    assert eng.step_trace is None


def test_trace_says_when_a_request_joined_and_made_its_first_token() -> None:
    model = LinearStepModel(0.001, 0.0, 0.0, 0.0, 0.0)
    eng = SimEngine(SimEngineConfig(tokenizer="bytes", realtime=True), model)
    eng.step_trace = io.StringIO()
    eng.add(make_request("a", prompt_len=8, max_tokens=3))
    for _ in range(3):
        eng.step()
    lines = [json.loads(x) for x in eng.step_trace.getvalue().splitlines()]
    events = [(x["event"], x["req_id"]) for x in lines if "event" in x]
    assert events == [("add", "a"), ("first", "a")]  # one first token, not one per token
    assert sum("emulated_s" in x for x in lines) == 3


def test_a_host_stall_is_not_made_up_by_the_next_steps() -> None:
    # The caller stalls 60 ms past a 20 ms step's emulated end; the step after it still takes
    # its 20 ms (it used to take none: counted from the emulated end, 40 ms in the past).
    model = LinearStepModel(STEP_S, 0.0, 0.0, 0.0, 0.0)
    eng = SimEngine(SimEngineConfig(tokenizer="bytes", num_layers=4, realtime=True), model)
    eng.add(make_request("a", prompt_len=4, max_tokens=8))
    eng.step()
    eng.step_origin = eng.last_step_end_s
    time.sleep(3 * STEP_S)  # the stall: host work between the steps
    eng.step()  # ends at once: its emulated time passed during the stall
    eng.step_origin = eng.last_step_end_s  # back to back from here
    t0 = time.perf_counter()
    eng.step()
    assert time.perf_counter() - t0 >= STEP_S * 0.95  # a whole step, not the stall repaid
