"""Sim engine control: preemption by recompute, swapping, export/import (migration)."""

from __future__ import annotations

import msgspec
import pytest

from tests.tidal.engine.sim.test_engine import make_engine, make_request, run_to_end
from tidal.engine.sim.engine import SimEngine, SimEngineConfig
from tidal.engine.sim.seq import kv_digest, kv_slice
from tidal.perf.api import BatchShape
from tidal.plan import StepPlan


def reference(prompt_len: int = 20, max_tokens: int = 8) -> list[int]:
    eng = make_engine()
    eng.add(make_request("a", prompt_len=prompt_len, max_tokens=max_tokens))
    return run_to_end(eng)["a"]


def step_tokens(eng: SimEngine, plan: StepPlan | None = None) -> list[int]:
    return [t for e in eng.step(plan).events for t in e.token_ids]


def test_preempt_by_recompute_resumes_with_identical_output() -> None:
    eng = make_engine(max_batch_tokens=8)
    eng.add(make_request("a", prompt_len=20, max_tokens=8))
    out: list[int] = []
    for _ in range(5):  # 3 prefill steps (8 + 8 + 4), 2 decodes: 3 tokens out
        out += step_tokens(eng)
    assert len(out) == 3
    eng.recompute("a")
    (snap,) = eng.snapshot()
    assert (snap.status, snap.num_computed_tokens, snap.num_blocks) == ("waiting", 0, 0)
    assert eng.num_free_blocks() == eng.num_kv_blocks
    # prompt + output = 23 tokens recomputed in chunks of 8, 8, 7; the last samples token 4
    assert [len(step_tokens(eng)) for _ in range(3)] == [0, 0, 1]
    assert eng.snapshot()[0].num_output_tokens == 4
    out += eng.seqs["a"].token_ids[-1:] + run_to_end(eng)["a"]
    assert out == reference()


def test_swap_out_and_in_keep_progress_and_account_blocks() -> None:
    eng = make_engine(block_size=4, num_kv_blocks=7, max_model_len=28)
    eng.add(make_request("a", prompt_len=20, max_tokens=8))
    eng.add(make_request("b", prompt_len=8, max_tokens=4))
    out = step_tokens(eng, StepPlan(prefill={"a": 20}))  # 5 blocks
    eng.swap_out("a")
    assert eng.num_free_blocks() == 7 and eng.has_work()  # b still waits
    (sa, _) = eng.snapshot()
    assert (sa.status, sa.num_blocks, sa.num_computed_tokens) == ("swapped", 0, 20)
    with pytest.raises(ValueError, match="running"):
        eng.swap_out("a")
    step_tokens(eng, StepPlan(prefill={"b": 8}))  # 2 blocks; b holds 9 tokens after its 1st out
    step_tokens(eng, StepPlan(decode=("b",)))  # b: 3 blocks; 4 free, a needs 5
    with pytest.raises(MemoryError):
        eng.swap_in("a")
    assert eng.snapshot()[0].status == "swapped"
    eng.abort("b")
    eng.swap_in("a")
    assert eng.snapshot()[0].num_blocks == 5 and eng.num_free_blocks() == 2
    eng.check_integrity()
    out += run_to_end(eng)["a"]
    assert out == reference()


def test_only_swapped_requests_means_no_work() -> None:
    eng = make_engine()
    eng.add(make_request("a"))
    eng.step()
    eng.swap_out("a")
    assert not eng.has_work() and eng.load().num_waiting == 1


def test_export_import_continues_identically_with_a_real_size_kv_blob() -> None:
    src, dst = make_engine(max_batch_tokens=8), make_engine(block_size=8)
    src.add(make_request("a", prompt_len=20, max_tokens=8))
    out: list[int] = []
    for _ in range(4):  # 20 prompt tokens + 1 decode: 21 tokens computed, 2 out
        out += step_tokens(src)
    data = src.export_request("a")
    assert not src.seqs and src.num_free_blocks() == src.num_kv_blocks
    payload = msgspec.msgpack.decode(data)
    # 21 KV tokens * 30 layers * (k, v) * 3 heads * 64 dims * 2 bytes
    assert len(payload["kv"]) == 21 * 23_040
    assert msgspec.msgpack.decode(payload["state"])["output_token_ids"] == out
    dst.import_request(data)
    (snap,) = dst.snapshot()
    assert (snap.status, snap.num_computed_tokens, snap.num_blocks) == ("running", 21, 3)
    out += run_to_end(dst)["a"]
    assert out == reference()


def test_export_with_a_smaller_kv_payload_still_reports_the_full_kv_size() -> None:
    kw = {"kv_payload_bytes_per_token": 0, "max_batch_tokens": 8}
    src, dst = make_engine(**kw), make_engine(block_size=8, kv_payload_bytes_per_token=0)
    assert src.kv_bytes_per_token == 23_040  # what the policy plans with is unchanged
    src.add(make_request("a", prompt_len=20, max_tokens=8))
    out: list[int] = []
    for _ in range(4):
        out += step_tokens(src)
    data = src.export_request("a")
    assert msgspec.msgpack.decode(data)["kv"] == b""
    dst.import_request(data)
    out += run_to_end(dst)["a"]
    assert out == reference()
    with pytest.raises(ValueError, match="KV of 0 bytes"):  # a full-size importer refuses it
        make_engine().import_request(data)


class PreemptingStepModel:
    """Signals a layer-boundary preemption while the step runs (no thread needed)."""

    def __init__(self) -> None:
        self.engine: SimEngine | None = None

    def step_s(self, batch: BatchShape) -> float:
        assert self.engine is not None and self.engine.request_layer_cut()
        return 0.3


def test_export_keeps_a_layer_preempted_chunk() -> None:
    model = PreemptingStepModel()
    src = SimEngine(SimEngineConfig(tokenizer="bytes", num_layers=10), model)
    model.engine = src
    src.add(make_request("a", prompt_len=20, max_tokens=8))
    res = src.step(StepPlan(prefill={"a": 12}))
    assert res.events == [] and src.last_step_preempted
    assert res.telemetry.step_s == pytest.approx(0.03)  # one layer of ten ran
    (snap,) = src.snapshot()
    assert (snap.forced_tokens, snap.num_computed_tokens, snap.num_blocks) == (12, 0, 1)
    data = src.export_request("a")
    payload = msgspec.msgpack.decode(msgspec.msgpack.decode(data)["state"])
    assert (payload["partial_tokens"], payload["partial_layer"]) == (12, 1)
    assert len(msgspec.msgpack.decode(data)["kv"]) == 12 * 23_040
    dst = make_engine(max_batch_tokens=8)  # its own planner resumes the chunk over budget
    dst.import_request(data)
    assert dst.snapshot()[0].forced_tokens == 12
    with pytest.raises(ValueError, match="resume"):
        dst.step(StepPlan(prefill={"a": 8}))
    assert run_to_end(dst)["a"] == reference()


def test_corrupt_foreign_or_duplicate_payloads_are_refused_without_changes() -> None:
    src = make_engine()
    src.add(make_request("a", prompt_len=20, max_tokens=8))
    src.step()
    data = src.export_request("a", remove=False)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF  # a byte of the KV blob
    dst = make_engine(num_kv_blocks=2, max_model_len=32)
    dst.add(make_request("b", prompt_len=8))
    dst.step()  # b takes one of the two blocks
    before = (dst.snapshot(), dst.num_free_blocks())
    roomy = make_engine()
    for bad in (bytes(flipped), data[:-5], b"\x00not msgpack", msgspec.msgpack.encode({"a": 1})):
        with pytest.raises(ValueError):
            roomy.import_request(bad)
    assert (roomy.snapshot(), roomy.num_free_blocks()) == ([], roomy.num_kv_blocks)
    roomy.check_integrity()
    with pytest.raises(MemoryError):  # 20 KV tokens need 2 blocks of 16; 1 is free
        dst.import_request(data)
    assert (dst.snapshot(), dst.num_free_blocks()) == before
    other = SimEngine(SimEngineConfig(model_name="other", tokenizer="bytes"))
    with pytest.raises(ValueError, match="model"):
        other.import_request(data)
    with pytest.raises(ValueError, match="already"):
        src.import_request(data)


def test_emulated_kv_depends_on_the_tokens_and_slices_consistently() -> None:
    a, b = kv_digest([1, 2, 3], 3), kv_digest([1, 2, 4], 3)
    assert kv_slice(a, 0, 30) != kv_slice(b, 0, 30)
    whole = kv_slice(a, 0, 2000)
    assert len(whole) == 2000
    assert kv_slice(a, 130, 1999) == whole[130:1999]  # a chunk is the same bytes as in the whole
