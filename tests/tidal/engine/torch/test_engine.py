"""Engine behaviour: layer-boundary preemption, export/import, swap, prefix cache, sampling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engine.api import EngineRequest, FinishReason, RequestClass, SamplingParams
from tidal.engine.torch.engine import TorchEngine
from tidal.plan import StepPlan


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(
    max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True
)


def drain(engine: TorchEngine, out: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    out = {} if out is None else out
    while engine.has_work():
        for ev in engine.step().events:
            out.setdefault(ev.req_id, []).extend(ev.token_ids)
        engine.check_integrity()
    return out


def reference(make_engine: Any, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    e = make_engine(chunk_size=16, token_budget=32)
    for rid, (p, sp) in reqs.items():
        e.add(EngineRequest(rid, p, sp))
    return drain(e)


REQS = {"a": (prompt(50, 1), GREEDY), "b": (prompt(9, 2), SAMPLED), "c": (prompt(30, 3), GREEDY)}


def test_preemption_mid_prefill_resumes_from_the_layer(make_engine: Any) -> None:
    ref = reference(make_engine, REQS)
    e = make_engine(chunk_size=16, token_budget=32)
    for rid, (p, sp) in REQS.items():
        e.add(EngineRequest(rid, p, sp))
    out: dict[str, list[int]] = {}

    def collect(events: list[Any]) -> None:
        for ev in events:
            out.setdefault(ev.req_id, []).extend(ev.token_ids)

    collect(e.step().events)  # a: 16 of 50 prompt tokens, b: 9 (done, first token), c: 7
    rows_per_layer: list[tuple[int, int]] = []

    def hook(layer: int, rows: int) -> None:
        rows_per_layer.append((layer, rows))
        if layer == 1 and len(rows_per_layer) == 2:
            assert e.request_layer_cut()

    e.model.layer_hook = hook
    res = e.step()  # b decodes, a and c prefill: cut after layer 2 of 4
    assert e.last_step_preempted and res.events == []
    assert e.last_preempt_latency_s is not None and e.last_preempt_latency_s >= 0
    a = e.seqs["a"]
    assert a.partial is not None and a.partial.layer == 2 and a.num_computed == 16
    e.check_integrity()
    rows_per_layer.clear()
    collect(e.step().events)  # resumes at layer 2: layers 0-1 have no rows to run
    assert [layer for layer, _ in rows_per_layer] == [2, 3]
    e.model.layer_hook = None
    assert a.partial is None and a.num_computed == 32
    assert drain(e, out) == ref
    assert not e.request_layer_cut()  # no step running: nothing to stop


def test_preempted_chunk_resumes_beside_fresh_work(make_engine: Any) -> None:
    ref = reference(make_engine, REQS)
    e = make_engine(chunk_size=16, token_budget=32)
    e.add(EngineRequest("a", *REQS["a"]))
    e.model.layer_hook = lambda layer, rows: layer == 0 and e.request_layer_cut()
    e.step()
    e.model.layer_hook = None
    assert e.seqs["a"].partial is not None and e.seqs["a"].partial.layer == 1
    e.add(EngineRequest("b", *REQS["b"]))
    e.add(EngineRequest("c", *REQS["c"]))
    rows: list[tuple[int, int]] = []
    e.model.layer_hook = lambda layer, n: rows.append((layer, n))
    out: dict[str, list[int]] = {}
    for ev in e.step().events:  # a resumes at layer 1 (16 rows); b (9), c (7) start at layer 0
        out.setdefault(ev.req_id, []).extend(ev.token_ids)
    assert rows[0] == (0, 16) and rows[1] == (1, 32)
    e.model.layer_hook = None
    assert drain(e, out) == ref


def run_with_export(make_engine: Any, at_step: int, preempt: bool) -> dict[str, list[int]]:
    src = make_engine(chunk_size=16, token_budget=32)
    dst = make_engine(chunk_size=16, token_budget=32)
    out: dict[str, list[int]] = {}
    for rid, (p, sp) in REQS.items():
        src.add(EngineRequest(rid, p, sp))
    for i in range(at_step):
        if preempt and i == at_step - 1:
            src.model.layer_hook = lambda layer, n: layer == 1 and src.request_layer_cut()
        for ev in src.step().events:
            out.setdefault(ev.req_id, []).extend(ev.token_ids)
    src.model.layer_hook = None
    for rid in list(src.seqs):
        dst.import_request(src.export_request(rid))
    assert not src.seqs and src.allocator.num_used == 0
    src.check_integrity()
    return drain(dst, out)


@pytest.mark.parametrize(("at_step", "preempt"), [(1, False), (4, False), (2, True)])
def test_export_import_continues_identically(make_engine: Any, at_step: int, preempt: bool) -> None:
    assert run_with_export(make_engine, at_step, preempt) == reference(make_engine, REQS)


def test_swap_out_and_in_gives_identical_output(make_engine: Any) -> None:
    ref = reference(make_engine, REQS)
    e = make_engine(chunk_size=16, token_budget=32)
    for rid, (p, sp) in REQS.items():
        e.add(EngineRequest(rid, p, sp))
    out: dict[str, list[int]] = {}
    for _ in range(3):
        for ev in e.step().events:
            out.setdefault(ev.req_id, []).extend(ev.token_ids)
    used = e.allocator.num_used
    e.swap_out("a")
    assert e.allocator.num_used < used and e.load().num_waiting == 1
    for _ in range(3):  # others progress while a's KV sits in host memory
        for ev in e.step().events:
            out.setdefault(ev.req_id, []).extend(ev.token_ids)
    e.check_integrity()
    e.swap_in("a")
    assert drain(e, out) == ref


def test_prefix_cache_shares_blocks_and_keeps_output(make_engine: Any) -> None:
    shared = prompt(40, 9)
    e = make_engine(chunk_size=64, token_budget=64)
    e.add(EngineRequest("first", [*shared, 1, 2, 3], GREEDY))
    first = drain(e)
    e.add(EngineRequest("second", [*shared, 1, 2, 3], GREEDY))
    hits_before = e.allocator.num_prefix_hits
    tokens = list(e.step().events[0].token_ids)
    assert e.seqs["second"].num_cached_tokens == 40  # 5 full blocks of 8
    assert e.allocator.num_prefix_hits - hits_before == 5
    assert drain(e, {"second": tokens}) == {"second": first["first"]}
    e.check_integrity()


def test_kv_pressure_preempts_by_recompute_without_changing_output(make_engine: Any) -> None:
    ref = reference(make_engine, REQS)
    e = make_engine(chunk_size=16, token_budget=32, kv_cache_tokens=72, enable_prefix_cache=False)
    for rid, (p, sp) in REQS.items():  # offline: only offline work is ever recomputed
        e.add(EngineRequest(rid, p, sp, RequestClass.OFFLINE))
    assert drain(e) == ref
    assert e.num_recompute_preemptions > 0  # 9 blocks for 16 blocks' worth of requests


def test_explicit_plan_and_step_log(make_engine: Any, tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    e = make_engine(step_log=str(log), profile_modules=True)
    e.add(EngineRequest("a", prompt(20, 1), GREEDY))
    e.add(EngineRequest("b", prompt(6, 2), GREEDY))
    res = e.step(StepPlan(prefill={"a": 5, "b": 6}))
    tel = res.telemetry
    assert (tel.num_prefill_tokens, tel.num_decode_tokens, tel.num_requests) == (11, 0, 2)
    assert tel.num_context_tokens == 11 and [ev.req_id for ev in res.events] == ["b"]
    assert set(tel.module_s) == {"qkv", "attention", "o_proj", "mlp"}
    res = e.step(StepPlan(prefill={"a": 15, "b": 1}))
    assert (res.telemetry.num_prefill_tokens, res.telemetry.num_decode_tokens) == (15, 1)
    assert res.telemetry.num_context_tokens == 20 + 7
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 2 and lines[1]["num_prefill_tokens"] == 15
    # 15 new after 5 cached: pairs 15*20; b decodes at position 7 (context 7)
    assert (lines[1]["prefill_attn_pairs"], lines[1]["decode_context_tokens"]) == (300, 7)
    from tidal.perf.steplog import read_step_log

    parsed = read_step_log(log)
    assert len(parsed) == 2 and parsed.batches[1].num_prefill_tokens == 15
    with pytest.raises(ValueError, match="unknown"):
        e.step(StepPlan(prefill={"nope": 1}))


def test_stop_strings_stop_ids_max_tokens_and_logprobs(make_engine: Any) -> None:
    e = make_engine()
    p = prompt(12, 3)
    e.add(EngineRequest("free", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
    free = drain(e)["free"]
    text = e.tokenizer.decode(free)
    stop = text[3:5]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop,), logprobs=0)
    e.add(EngineRequest("s", p, sp))
    events = []
    while e.has_work():
        events += e.step().events
    assert events[-1].finish_reason == FinishReason.STOP
    streamed = "".join(ev.text for ev in events)
    assert streamed == text[: text.index(stop)] and stop not in streamed
    assert all(len(ev.logprobs) == 1 and ev.logprobs[0] <= 0 for ev in events)
    sp = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(free[2],))
    e.add(EngineRequest("t", p, sp))
    evs = [ev for _ in range(20) if e.has_work() for ev in e.step().events]
    assert [t for ev in evs for t in ev.token_ids] == free[: free.index(free[2]) + 1]
    assert evs[-1].finish_reason == FinishReason.STOP and evs[-1].num_output_tokens <= 3


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(make_engine: Any) -> None:
    outs = []
    for _ in range(2):
        e = make_engine()
        e.add(EngineRequest("r", prompt(10, 1), SAMPLED))
        outs.append(drain(e)["r"])
    e = make_engine()
    e.add(EngineRequest("r", prompt(10, 1), SamplingParams(max_tokens=8, temperature=0)))
    assert outs[0] == outs[1] and len(outs[0]) == 8
    assert drain(e)["r"] != outs[0]


def test_add_validation_abort_and_load(make_engine: Any) -> None:
    e = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        e.add(EngineRequest("long", prompt(64, 1), GREEDY))
    with pytest.raises(ValueError, match="empty"):
        e.add(EngineRequest("empty", [], GREEDY))
    with pytest.raises(ValueError, match="token ids"):
        e.add(EngineRequest("bad", [999], GREEDY))
    e.add(EngineRequest("on", prompt(20, 1), GREEDY))
    e.add(EngineRequest("off", prompt(20, 2), GREEDY, req_class=RequestClass.OFFLINE))
    with pytest.raises(ValueError, match="already"):
        e.add(EngineRequest("on", prompt(20, 1), GREEDY))
    e.step()
    load = e.load()
    assert (load.num_online, load.num_offline, load.num_running) == (1, 1, 2)
    assert load.num_kv_blocks_used == 6 and load.num_kv_blocks_total == 512
    assert e.abort("on") and not e.abort("on")
    e.check_integrity()
    e.add(EngineRequest("cap", prompt(60, 3), SamplingParams(max_tokens=100, temperature=0)))
    out = [ev for _ in range(200) if e.has_work() for ev in e.step().events if ev.req_id == "cap"]
    assert out[-1].finish_reason == FinishReason.LENGTH and out[-1].num_output_tokens == 4
