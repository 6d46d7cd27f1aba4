"""The `sglang` engine adapter against a fake SGLang server (`fake_sglang`, written from SGLang
0.5.23's source). These test the adapter alone; a real SGLang runs in
tests/e2e/test_sglang_real.py (`make test-sglang`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import pytest

from services.instance.engines import build_engine
from services.instance.sglang.api import PRIORITY
from services.instance.sglang.client import SglangClient
from services.instance.sglang.engine import SglangEngine
from tests.services.instance.sglang.fake_sglang import FakeSglang, next_token
from tidal.cluster.view import sync_instance
from tidal.engine.api import (
    ControllableEngine,
    EngineRequest,
    FinishReason,
    RequestClass,
    SamplingParams,
    StepPlan,
    TokenEvent,
)
from tidal.engine.executor import execute
from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import InstanceRole, InstanceState, ReqState, Slo

PROMPT = [11, 12, 13, 14, 15]


class WordTokenizer:
    """Token i is the word "w<i> "; enough to check text without loading a model."""

    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"w{t} " for t in token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return " ".join(m["content"] for m in messages)


def greedy(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token([*prompt, *out]))
    return out


@pytest.fixture
def fake() -> Iterator[FakeSglang]:
    f = FakeSglang()
    with f.serve():
        yield f


def make_engine(url: str, poll_s: float = 0.02) -> SglangEngine:
    return SglangEngine(SglangClient(url), WordTokenizer(), "fake-model", 4096, 20000, 0.0, poll_s)


@pytest.fixture
def engine(fake: FakeSglang) -> Iterator[SglangEngine]:
    eng = make_engine(fake.url)
    yield eng
    eng.close()


def req(
    rid: str, n: int = 8, cls: RequestClass = RequestClass.OFFLINE, **sp: object
) -> EngineRequest:
    return EngineRequest(rid, list(PROMPT), SamplingParams(max_tokens=n, temperature=0, **sp), cls)  # type: ignore[arg-type]


def run(
    eng: SglangEngine, plan: StepPlan | None = None, until: str = "", timeout_s: float = 60.0
) -> list[TokenEvent]:
    """Step until `until` (or every request) has finished; every event."""
    events: list[TokenEvent] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events += eng.step(plan).events
        done = {e.req_id for e in events if e.finish_reason is not None}
        if (until and until in done) or (not until and not eng.has_work()):
            return events
    raise AssertionError(f"not finished in {timeout_s} s: {events[-3:]}")


def tokens_of(events: list[TokenEvent], rid: str) -> list[int]:
    return [t for e in events if e.req_id == rid for t in e.token_ids]


def test_it_is_a_controllable_engine(engine: SglangEngine) -> None:
    assert isinstance(engine, ControllableEngine)
    assert not engine.is_emulated and engine.name == "sglang"


def test_a_request_streams_sglangs_tokens_with_the_fields_sglang_defines(
    engine: SglangEngine, fake: FakeSglang
) -> None:
    engine.add(req("a", 8, RequestClass.ONLINE, top_k=0, seed=7))
    events = run(engine)
    assert tokens_of(events, "a") == greedy(PROMPT, 8)
    last = events[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.num_output_tokens == 8
    assert "".join(e.text for e in events) == WordTokenizer().decode(greedy(PROMPT, 8))
    (body,) = fake.bodies
    assert body["input_ids"] == PROMPT and body["stream"] is True
    assert body["priority"] == PRIORITY[RequestClass.ONLINE] > PRIORITY[RequestClass.OFFLINE]
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 8 and sp["top_k"] == -1 and sp["sampling_seed"] == 7
    assert fake.aborts == []  # SGLang ended it itself: nothing to abort


def test_offline_requests_enter_sglang_only_when_the_plan_admits_them(
    engine: SglangEngine, fake: FakeSglang
) -> None:
    engine.add(req("on", 4, RequestClass.ONLINE))
    engine.add(req("off", 4))
    events = run(engine, StepPlan(prefill={"on": 5}), until="on")
    assert [b["rid"] for b in fake.bodies] == [engine_rid_seen(fake, 0)]
    assert {e.req_id for e in events} == {"on"}
    snap = {s.req_id: s.status for s in engine.snapshot()}
    assert snap == {"off": "waiting"}
    assert engine.load().num_waiting >= 1
    events = run(engine, StepPlan(prefill={"off": 5}), until="off")
    assert tokens_of(events, "off") == greedy(PROMPT, 4)
    assert fake.bodies[1]["priority"] == PRIORITY[RequestClass.OFFLINE]


def engine_rid_seen(fake: FakeSglang, i: int) -> str:
    rid = fake.bodies[i]["rid"]
    assert isinstance(rid, str)
    return rid


def test_rids_are_unique_and_none_is_a_prefix_of_another(
    engine: SglangEngine, fake: FakeSglang
) -> None:
    for i in range(6):
        engine.add(req(f"r{i}", 2))
    run(engine)
    rids = [b["rid"] for b in fake.bodies]
    assert len(set(rids)) == 6 and len({len(r) for r in rids}) == 1


def test_preemption_aborts_in_sglang_and_resumes_from_the_generated_tokens(
    engine: SglangEngine, fake: FakeSglang
) -> None:
    engine.add(req("x", 40))
    events: list[TokenEvent] = []
    while len(tokens_of(events, "x")) < 5:
        events += engine.step(None).events
    engine.recompute("x")
    wait_for(lambda: fake.aborts == [fake.bodies[0]["rid"]], "the abort to reach SGLang")
    assert [s.status for s in engine.snapshot()] == ["waiting"]
    events += run(engine)
    got = tokens_of(events, "x")
    assert got == greedy(PROMPT, 40)  # nothing repeated, nothing lost
    resumed = fake.bodies[1]
    n_before = len(resumed["input_ids"]) - len(PROMPT)
    assert resumed["input_ids"] == PROMPT + got[:n_before]
    assert resumed["sampling_params"]["max_new_tokens"] == 40 - n_before
    assert "".join(e.text for e in events) == WordTokenizer().decode(got)


def test_a_stop_string_is_cut_here_and_the_request_aborted_in_sglang(
    engine: SglangEngine, fake: FakeSglang
) -> None:
    want = greedy(PROMPT, 30)
    stop = f"w{want[5]} "
    engine.add(req("s", 30, stop=(stop,)))
    events = run(engine)
    assert events[-1].finish_reason is FinishReason.STOP
    text = "".join(e.text for e in events)
    assert text == WordTokenizer().decode(want)[: WordTokenizer().decode(want).find(stop)]
    wait_for(lambda: fake.aborts == [fake.bodies[0]["rid"]], "the abort to reach SGLang")


def test_recompute_migration_moves_tokens_and_text_position(fake: FakeSglang) -> None:
    other = FakeSglang()
    with other.serve():
        src, dst = make_engine(fake.url), make_engine(other.url)
        try:
            src.add(req("m", 30, RequestClass.ONLINE))
            events: list[TokenEvent] = []
            while len(tokens_of(events, "m")) < 6:
                events += src.step(None).events
            data = src.export_request("m")
            assert not src.has_work()
            wait_for(lambda: fake.aborts == [fake.bodies[0]["rid"]], "the abort at the source")
            dst.import_request(data)
            # pushed in running: into SGLang though the plan names nothing (a strict instance's
            # OOCO plan admits no online prefill)
            events += run(dst, StepPlan())
            assert tokens_of(events, "m") == greedy(PROMPT, 30)
            assert "".join(e.text for e in events) == WordTokenizer().decode(greedy(PROMPT, 30))
            assert other.bodies[0]["priority"] == PRIORITY[RequestClass.ONLINE]
            assert src.migration_mode == "recompute"
        finally:
            src.close()
            dst.close()


def test_foreign_or_corrupt_payloads_are_refused(engine: SglangEngine) -> None:
    with pytest.raises(ValueError, match="not an SGLang"):
        engine.import_request(b'{"kind": "kv"}')
    with pytest.raises(ValueError, match="corrupt"):
        engine.import_request(b"\x00garbage")
    engine.add(req("p", 4))
    data = engine.export_request("p", remove=False)
    other = make_engine(engine.client.base_url)
    other.model_name = "another-model"
    try:
        with pytest.raises(ValueError, match="another-model"):
            other.import_request(data)
    finally:
        other.close()


def test_sglang_refusing_a_request_is_an_error_event(
    engine: SglangEngine, fake: FakeSglang
) -> None:
    fake.refuse = "max_new_tokens too large"
    engine.add(req("bad", 4))
    events = run(engine)
    (last,) = [e for e in events if e.finish_reason is not None]
    assert last.finish_reason is FinishReason.ERROR
    assert "HTTP 400" in last.error and "max_new_tokens too large" in last.error


def test_load_comes_from_v1_loads(engine: SglangEngine) -> None:
    wait_for(lambda: engine.client.load.max_total_tokens == 20000, "a /v1/loads reading")
    load = engine.load()
    assert load.num_kv_blocks_total == 20000
    assert engine.info()["sglang_gen_throughput"] == "123.0"


def test_bad_requests_are_clear_errors(engine: SglangEngine) -> None:
    with pytest.raises(ValueError, match="context length"):
        engine.add(EngineRequest("long", [5] * 4000, SamplingParams(max_tokens=200)))
    with pytest.raises(ValueError, match="unknown request"):
        engine.recompute("nobody")


def test_build_engine_attaches_to_a_server_and_needs_a_model(fake: FakeSglang, tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = argparse.Namespace(
        engine="sglang",
        model="",
        sglang_url=fake.url,
        sglang_args="",
        sglang_python="",
        sglang_start_timeout_s=10.0,
        max_model_len=0,
    )
    with pytest.raises(ValueError, match="--model"):
        build_engine(args)


def wait_for(pred, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_requests_in_sglang_stream_even_when_the_plan_names_none(engine: SglangEngine) -> None:
    """Once admitted a request runs in SGLang by itself: the executor still steps the engine
    for an empty plan so its tokens go out."""
    engine.add(req("e", 6))
    events = execute(engine, StepPlan(prefill={"e": 5})).result
    got = list(events.events) if events else []
    deadline = time.monotonic() + 30
    while engine.has_work() and time.monotonic() < deadline:
        ex = execute(engine, StepPlan())
        assert ex.result is not None
        got += ex.result.events
    assert tokens_of(got, "e") == greedy(PROMPT, 6)


def test_a_stop_token_ends_the_request_as_output_but_not_as_text(engine: SglangEngine) -> None:
    want = greedy(PROMPT, 30)
    engine.add(req("t", 30, stop_token_ids=(want[3],)))
    events = run(engine)
    assert events[-1].finish_reason is FinishReason.STOP
    assert tokens_of(events, "t") == want[:4]  # SGLang stopped on it
    assert "".join(e.text for e in events) == WordTokenizer().decode(want[:3])


@pytest.mark.parametrize("role", [InstanceRole.RELAXED, InstanceRole.STRICT])
def test_the_policy_never_preempts_a_request_sglang_has_not_answered_yet(
    role: InstanceRole,
) -> None:
    """A request in SGLang with no token back yet is, to the policy, a prefill one token from
    done (`snapshot`): the `tidal` policy neither preempts it as stuck nor plans around it. It
    saw a prefill with nothing left, which OOCO's relaxed step preempts as stuck: live, every
    offline request was resubmitted and aborted each step (12k times in 5 minutes)."""
    slow = FakeSglang(token_s=30.0)  # no token comes during the test
    with slow.serve():
        eng = make_engine(slow.url)
        try:
            eng.add(req("off", 8))
            eng.step(StepPlan(prefill={"off": len(PROMPT)}))
            deadline = time.monotonic() + 10  # the submission's POST lands on the server's thread
            while not slow.bodies and time.monotonic() < deadline:
                time.sleep(0.01)
            assert slow.bodies, "submitted"
            slo = Slo(1.0, 0.25)
            policy = make_policy("tidal", PolicyContext(2, (role, role), slo, {}, seed=0))
            inst = InstanceState(0, role, 256, 8, 1, 20000, 20000, LinearStepModel(), 1, 1e9)
            inst.num_layers = 1  # as the worker sets it: SGLang cannot cut a step at a layer
            reqs: dict[str, ReqState] = {}
            for _ in range(5):
                sync_instance(inst, eng.snapshot(), reqs, eng.num_free_blocks())
                (r,) = reqs.values()
                assert r.num_prefill_left == 1 and not r.is_decoding
                plan = policy.schedule(inst, 0.0)
                assert "off" not in plan.recompute and "off" not in plan.swap_out
                execute(eng, plan, {})
            assert len(slow.bodies) == 1 and not slow.aborts
        finally:
            eng.close()


def test_sglang_priority_retractions_are_counted() -> None:
    """Two offline requests fill SGLang's two slots; an online one (priority 100 > 0 + 10)
    retracts one of them inside SGLang. The engine counts it from `meta_info.num_retractions`
    and every request still gets all its tokens."""
    small = FakeSglang(max_running=2, token_s=0.01)
    with small.serve():
        eng = make_engine(small.url)
        try:
            eng.add(req("off-a", 40))
            eng.add(req("off-b", 40))
            events: list[TokenEvent] = []
            while len(tokens_of(events, "off-b")) < 3:
                events += eng.step(None).events
            eng.add(req("on", 5, RequestClass.ONLINE))
            events += run(eng)
            assert eng.num_sglang_retractions == 1
            assert eng.info()["sglang_retractions_total"] == "1"
            for rid, n in (("off-a", 40), ("off-b", 40), ("on", 5)):
                assert tokens_of(events, rid) == greedy(PROMPT, n)
        finally:
            eng.close()
