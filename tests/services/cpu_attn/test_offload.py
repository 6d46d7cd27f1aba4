"""Decode attention on CPU-attention workers (OmniServe §3.2) against the same request decoded
on the instance alone: the torch engine on the tiny random Llama, real workers over TCP."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from services.instance.cpu_attn_link import CpuAttnPool
from tests.services.cpu_attn.conftest import WorkerFactory
from tidal.engine.api import EngineRequest, OffloadRefused, SamplingParams
from tidal.engine.torch.engine import TorchEngine
from tidal.plan import StepPlan

PROMPT = [ord(c) for c in "The tide comes in and the tide goes out; "]


def req(rid: str, max_tokens: int = 24, prompt: list[int] | None = None) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, list(prompt or PROMPT), sp)


def with_workers(
    make_engine: Any, pool: CpuAttnPool, reqs: list[EngineRequest], *engine_args: Any
) -> tuple[TorchEngine, dict[str, list[int]]]:
    """A fresh engine using `pool`'s workers, with `reqs` added; and its outputs so far."""
    engine = make_engine(*engine_args)
    engine.attach_cpu_attn(pool)
    for r in reqs:
        engine.add(r)
    return engine, {}


def run_alone(engine: TorchEngine, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.req_id: [] for r in reqs}
    for r in reqs:
        engine.add(r)
    while engine.has_work():
        for ev in engine.step().events:
            out[ev.req_id] += ev.token_ids
    return out


def eventually(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def offloaded(engine: TorchEngine) -> tuple[str, ...]:
    return tuple(s.req_id for s in engine.snapshot() if s.status == "offloaded")


def step_mixed(engine: TorchEngine, out: dict[str, list[int]]) -> None:
    """One step: every GPU-resident request by the engine's own planner, every offloaded one
    by piggybacking."""
    on_gpu = engine.planner.plan(engine.schedulable(), engine.num_free_blocks(), engine.block_size)
    plan = StepPlan(prefill=on_gpu.prefill, decode=on_gpu.decode, cpu_decode=offloaded(engine))
    for ev in engine.step(plan).events:
        out.setdefault(ev.req_id, []).extend(ev.token_ids)


def decode_until(engine: TorchEngine, out: dict[str, list[int]], rid: str, n: int) -> None:
    for _ in range(2000):
        if len(out.get(rid, [])) >= n or rid not in engine.seqs:
            return
        step_mixed(engine, out)
    raise AssertionError(f"{rid} did not reach {n} tokens")


def finish(engine: TorchEngine, out: dict[str, list[int]]) -> None:
    for _ in range(5000):
        if not engine.has_work():
            return
        step_mixed(engine, out)
    raise AssertionError("requests did not finish")


def test_offload_mid_decode_and_recall_later_keep_greedy_output(
    make_engine: Any, make_worker: WorkerFactory, pool: CpuAttnPool
) -> None:
    want = run_alone(make_engine(), [req("a")])
    w = make_worker()
    pool.connect("w0", "127.0.0.1", w.port)
    engine, out = with_workers(make_engine, pool, [req("a")])
    decode_until(engine, out, "a", 5)
    used = engine.num_kv_blocks - engine.num_free_blocks()
    engine.offload("a")
    assert offloaded(engine) == ("a",)
    assert engine.num_kv_blocks - engine.num_free_blocks() == 0 < used  # its blocks are free
    assert w.store.stats().num_requests == 1
    decode_until(engine, out, "a", 14)
    assert offloaded(engine) == ("a",)  # 9 tokens with attention on the worker
    engine.recall("a")
    assert not offloaded(engine)
    eventually(lambda: w.store.stats().num_requests == 0)  # the drop is sent, not awaited
    finish(engine, out)
    assert out == want
    engine.check_integrity()


def test_mixed_steps_with_gpu_and_offloaded_decodes_keep_every_output(
    make_engine: Any, make_worker: WorkerFactory, pool: CpuAttnPool
) -> None:
    prompts = {f"r{i}": PROMPT[i:] + [ord("a") + i] * (3 + 2 * i) for i in range(6)}
    reqs = [req(rid, 20, p) for rid, p in prompts.items()]
    want = run_alone(make_engine(), [req(rid, 20, p) for rid, p in prompts.items()])
    for i in range(2):
        pool.connect(f"w{i}", "127.0.0.1", make_worker().port)
    engine, out = with_workers(make_engine, pool, reqs)
    decode_until(engine, out, "r5", 3)
    for rid in ("r1", "r3", "r4"):  # three offloaded, three stay: every step mixes both
        engine.offload(rid)
    assert {pool.where[r] for r in ("r1", "r3", "r4")} == {"w0", "w1"}  # spread over both
    finish(engine, out)
    assert out == want
    engine.check_integrity()


def test_a_worker_killed_mid_decode_loses_nothing(
    make_engine: Any, make_worker: WorkerFactory, pool: CpuAttnPool
) -> None:
    want = run_alone(make_engine(), [req("a", 30), req("b", 30)])
    w = make_worker()
    pool.connect("w0", "127.0.0.1", w.port)
    engine, out = with_workers(make_engine, pool, [req("a", 30), req("b", 30)])
    decode_until(engine, out, "a", 4)
    engine.offload("a")
    decode_until(engine, out, "a", 10)
    w.kill()
    finish(engine, out)  # "a" is recomputed from prompt + its 10 tokens, then goes on
    assert out == want
    assert engine.num_cpu_attn_lost == 1
    engine.check_integrity()


def test_a_full_worker_refuses_with_a_reason_and_the_request_stays(
    make_engine: Any, make_worker: WorkerFactory, pool: CpuAttnPool
) -> None:
    want = run_alone(make_engine(), [req("a")])
    w = make_worker(capacity_bytes=4096)  # far less than one request's KV
    pool.connect("w0", "127.0.0.1", w.port)
    engine, out = with_workers(make_engine, pool, [req("a")])
    decode_until(engine, out, "a", 3)
    with pytest.raises(OffloadRefused, match=r"worker full: needs .* MiB"):
        engine.offload("a")
    assert not offloaded(engine) and w.store.stats().num_refused == 1
    finish(engine, out)
    assert out == want


def test_recall_in_the_middle_of_a_token_runs_that_token_again_on_the_instance(
    make_engine: Any, make_worker: WorkerFactory, pool: CpuAttnPool
) -> None:
    want = run_alone(make_engine(), [req("a"), req("b", 24, PROMPT[3:])])
    w = make_worker()
    pool.connect("w0", "127.0.0.1", w.port)
    engine, out = with_workers(make_engine, pool, [req("a"), req("b", 24, PROMPT[3:])])
    decode_until(engine, out, "a", 4)
    decode_until(engine, out, "b", 4)
    engine.offload("a")
    w.loop.call_soon_threadsafe(time.sleep, 1.0)  # the worker stalls: no output comes back
    for ev in engine.step(StepPlan(decode=("b",), cpu_decode=("a",))).events:
        out[ev.req_id] += ev.token_ids
    cpu = engine.seqs["a"].cpu
    assert cpu is not None and cpu.stage == "wait" and cpu.layer == 0  # mid-token
    engine.recall("a")
    assert not offloaded(engine)
    finish(engine, out)
    assert out == want
    engine.check_integrity()


@pytest.mark.slow
def test_smollm2_offloaded_mid_decode_and_recalled_keeps_greedy_output(
    make_worker: WorkerFactory, pool: CpuAttnPool
) -> None:
    from tidal.engine.torch.loader import load_torch_engine

    # NOTE: float32 so the worker's attention and the instance's agree to the last bit that
    # matters for argmax over 24 tokens; bf16 rounds differently per kernel.
    def make() -> TorchEngine:
        return load_torch_engine(None, dtype="float32", kv_cache_tokens=4096)

    engine = make()
    prompt = engine.tokenizer.encode("The tide comes in twice a day because")
    want = run_alone(engine, [req("a", 24, prompt)])
    pool.connect("w0", "127.0.0.1", make_worker().port)
    engine = make()
    engine.attach_cpu_attn(pool)
    out: dict[str, list[int]] = {}
    engine.add(req("a", 24, prompt))
    decode_until(engine, out, "a", 4)
    engine.offload("a")
    decode_until(engine, out, "a", 16)
    engine.recall("a")
    finish(engine, out)
    assert out == want
