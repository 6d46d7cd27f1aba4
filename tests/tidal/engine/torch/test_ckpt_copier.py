"""The background checkpoint copier on the torch engine with SmolLM2-135M: the copies equal the
synchronous ones bit for bit; a release while copies are queued waits for the one under way
(kept) and cancels those not started (their tokens lost, their budget returned); the request
then resumes with the same greedy tokens as an uninterrupted run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tidal.engine.api import EngineRequest, RequestClass, SamplingParams
from tidal.engine.executor import execute
from tidal.engine.torch.checkpoint import JOB_BLOCKS
from tidal.engine.torch.ckpt_copier import CopyJob, JobState
from tidal.engine.torch.engine import TorchEngine
from tidal.engine.torch.engine_config import EngineConfig
from tidal.plan import StepPlan

BS = 4  # small blocks: a request of ~60 tokens spans more than one copy job
JOB = JOB_BLOCKS * BS
SP = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
Factory = Callable[..., TorchEngine]


@pytest.fixture(scope="module")
def smollm2() -> TorchEngine:
    from tidal.engine.torch.loader import load_torch_engine

    return load_torch_engine(None, dtype="float32", kv_cache_tokens=256, block_size=BS)


@pytest.fixture
def make(smollm2: TorchEngine) -> Factory:
    def make(**kw: Any) -> TorchEngine:
        cfg = EngineConfig(**({"kv_cache_tokens": 256, "block_size": BS} | kw))
        return TorchEngine(smollm2.model, smollm2.tokenizer, smollm2.model_name, cfg)

    return make


def start(e: TorchEngine, computed: int) -> list[int]:
    """Offline `r` prefilled and decoded (no checkpoints) until `computed` tokens have KV."""
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    e.add(EngineRequest("r", e.tokenizer.encode(text), SP, RequestClass.OFFLINE))
    out: list[int] = []
    while e.seqs["r"].num_computed < computed:
        res = execute(e, StepPlan(decode=("r",)) if out else StepPlan(prefill={"r": 64})).result
        assert res is not None
        out += [t for ev in res.events for t in ev.token_ids]
    return out


def finish(e: TorchEngine, out: list[int]) -> list[int]:
    while e.has_work():
        out += [t for ev in e.step().events for t in ev.token_ids]
        e.check_integrity()
    return out


def test_background_copies_equal_synchronous_ones(make: Factory) -> None:
    copies = []
    for background in (True, False):
        e = make(checkpoint_host_bytes=1 << 26, checkpoint_background=background)
        start(e, 2 * JOB + 2)
        execute(e, StepPlan(checkpoint=("r",)))
        seq = e.seqs["r"]
        if background:
            assert seq.num_ckpt_queued == 2 * JOB and len(seq.ckpt_jobs) + len(seq.ckpt) == 2
            e.check_integrity()  # exact while copies are queued
            e.wait_checkpoints()
        else:  # copied inside the stage
            assert not seq.ckpt_jobs and e.ckpt_copier.num_queued == 0
        assert seq.num_ckpt_tokens == 2 * JOB and [c.shape[2] for c in seq.ckpt] == [JOB, JOB]
        copies.append(torch.cat(seq.ckpt, dim=2))
        e.check_integrity()
    assert torch.equal(copies[0], copies[1])


def test_release_waits_for_the_copy_under_way_and_cancels_the_rest(
    make: Factory, smollm2: TorchEngine
) -> None:
    ref = finish(ref_e := make(), start(ref_e, 2 * JOB + 2))
    e = make(checkpoint_host_bytes=1 << 26)
    out = start(e, 2 * JOB + 2)
    copier = e.ckpt_copier
    real_copy = copier._copy
    started, go = threading.Event(), threading.Event()

    def gated(job: CopyJob) -> torch.Tensor:  # the first job holds until `go`
        result = real_copy(job)
        if job.start == 0:
            started.set()
            assert go.wait(30)
        return result

    copier._copy = gated  # type: ignore[method-assign]
    execute(e, StepPlan(checkpoint=("r",)))  # two jobs: [0, JOB) under way, [JOB, 2 JOB) queued
    assert started.wait(30)
    seq = e.seqs["r"]
    assert [j.state for j in seq.ckpt_jobs] == [JobState.RUNNING, JobState.PENDING]
    computed = seq.num_computed
    timer = threading.Timer(0.2, go.set)
    timer.start()
    execute(e, StepPlan(release=("r",)))
    timer.join()
    assert go.is_set() and e.last_release_s is not None and e.last_release_s >= 0.15
    assert seq.num_ckpt_tokens == seq.num_computed == JOB  # the copy under way was kept
    assert e.num_checkpoint_cancelled_tokens == JOB  # the one not started was dropped
    assert e.num_checkpoint_lost_tokens == computed - JOB
    assert e.num_checkpoint_bytes == int(JOB * e.kv_bytes_per_token)  # its budget returned
    assert e.allocator.num_free == e.num_kv_blocks and copier.num_queued == 0
    e.check_integrity()
    execute(e, StepPlan(swap_in=("r",)))
    assert e.num_restored_tokens == JOB
    assert finish(e, out) == ref


def test_release_with_no_copy_started_keeps_nothing_and_recomputes_all(make: Factory) -> None:
    ref = finish(ref_e := make(), start(ref_e, JOB + 3))
    e = make(checkpoint_host_bytes=1 << 26)
    out = start(e, JOB + 3)
    e.ckpt_copier.pause()  # the worker holds before its first job
    execute(e, StepPlan(checkpoint=("r",)))
    seq = e.seqs["r"]
    assert [j.state for j in seq.ckpt_jobs] == [JobState.PENDING]
    computed = seq.num_computed
    execute(e, StepPlan(release=("r",)))
    e.ckpt_copier.resume()
    assert seq.num_ckpt_tokens == seq.num_computed == 0 and e.num_checkpoint_bytes == 0
    assert e.num_checkpoint_cancelled_tokens == JOB and e.num_checkpoint_lost_tokens == computed
    assert e.snapshot()[0].is_released and e.ckpt_copier.num_queued == 0
    e.check_integrity()
    execute(e, StepPlan(swap_in=("r",)))
    assert finish(e, out) == ref
