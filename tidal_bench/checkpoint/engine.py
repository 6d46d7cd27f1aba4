"""The torch engine half of `tidal bench checkpoint`: N offline requests with `context`-token
prompts decode `decode` tokens, are preempted all at once, resume and decode `after` more. Four
ways to preempt: `recompute` (drop the KV; prefill prompt + output again), `swap` (copy all KV
to host at preemption, back at resume), `checkpoint` (full blocks queued for the background
copier every step, copied beside the step; the preemption frees the blocks with no copy, the
copy under way waited for and any not started dropped; resume copies the checkpoint back and
prefills the tail) and `checkpoint-sync` (the same, the copy inside the plan's checkpoint
stage, before the step). Every figure is wall time on this machine (measured); the prefix cache
is off (see `make_engine`)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tidal.engine.tokenizer import TidalTokenizer
    from tidal.engine.torch.engine import TorchEngine

MODES = ("recompute", "swap", "checkpoint", "checkpoint-sync")


@dataclass(frozen=True)
class Scenario:
    num_requests: int  # offline decodes preempted together
    context: int  # prompt tokens of each
    decode: int  # tokens each decodes before the preemption
    after: int  # tokens each decodes after it resumes
    block_size: int = 16


@dataclass
class Figures:
    mode: str
    decode_step_ms: float  # median decode step before the preemption (checkpoint copy included)
    first_step_ms: float  # the first decode step: its checkpoint is the whole prompt's KV
    mean_step_ms: float  # mean decode step before the preemption
    copy_ms: float  # time spent copying checkpoints while decoding (copier thread or stage)
    free_ms: float  # preemption stage: call to every GPU block free
    resume_ms: float  # from resume to every request decoding again
    tokens_recomputed: int  # KV tokens computed again on resume (all requests)
    host_bytes: int  # host memory holding their KV at the preemption
    equal_to_uninterrupted: bool  # greedy tokens equal a run with no preemption


def make_engine(
    base: TorchEngine, sc: Scenario, host_bytes: int, background: bool = True
) -> TorchEngine:
    from tidal.engine.torch.engine import TorchEngine
    from tidal.engine.torch.engine_config import EngineConfig

    per_req = sc.context + sc.decode + sc.after + 2 * sc.block_size
    cfg = EngineConfig(
        block_size=sc.block_size,
        kv_cache_tokens=sc.num_requests * per_req,
        token_budget=max(512, sc.context),
        chunk_size=max(512, sc.context),
        checkpoint_host_bytes=host_bytes,
        checkpoint_background=background,
        # NOTE: off: blocks a preemption frees go to the work it made room for, so a recompute
        # cannot find its old KV in the prefix cache (here nothing else would take them)
        enable_prefix_cache=False,
    )
    tok = cast("TidalTokenizer", base.tokenizer)  # the same weights, tokenizer and name
    return TorchEngine(base.model, tok, base.model_name, cfg)


def prompts(sc: Scenario, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(39)
    n = sc.num_requests
    return [torch.randint(100, vocab, (sc.context,), generator=g).tolist() for _ in range(n)]


def _start(e: TorchEngine, sc: Scenario, vocab: int) -> dict[str, list[int]]:
    from tidal.engine.api import EngineRequest, RequestClass, SamplingParams

    sp = SamplingParams(max_tokens=sc.decode + sc.after + 1, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts(sc, vocab)):
        e.add(EngineRequest(f"off{i}", p, sp, RequestClass.OFFLINE, float(i)))
        out[f"off{i}"] = []
    _until_decoding(e, out)
    return out


def _collect(events: Any, out: dict[str, list[int]]) -> None:
    for ev in events:
        out[ev.req_id] += ev.token_ids


def _until_decoding(e: TorchEngine, out: dict[str, list[int]]) -> None:
    """Prefill chunks only (no decodes beside them) until every request decodes."""
    from tidal.plan import StepPlan

    while todo := {r: s.num_pending for r, s in e.seqs.items() if not s.is_decode}:
        budget, chunks = e.config.token_budget, {}
        for rid, n in todo.items():
            if budget > 0:
                chunks[rid] = min(n, budget)
                budget -= chunks[rid]
        _collect(e.step(StepPlan(prefill=chunks)).events, out)


def uninterrupted(base: TorchEngine, sc: Scenario) -> dict[str, list[int]]:
    e = make_engine(base, sc, 0)
    out = _start(e, sc, base.model.config.vocab_size)
    while e.has_work():
        _collect(e.step().events, out)
    return out


def measure(base: TorchEngine, sc: Scenario, mode: str, ref: dict[str, list[int]]) -> Figures:
    from tidal.engine.executor import execute
    from tidal.plan import StepPlan

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ckpt = mode.startswith("checkpoint")
    e = make_engine(base, sc, 1 << 40 if ckpt else 0, background=mode == "checkpoint")
    out = _start(e, sc, base.model.config.vocab_size)
    rids = tuple(out)
    steps: list[float] = []
    for _ in range(sc.decode):
        t0 = time.perf_counter()
        res = execute(e, StepPlan(decode=rids, checkpoint=rids if ckpt else ())).result
        steps.append(time.perf_counter() - t0)
        assert res is not None
        _collect(res.events, out)
    before = sum(e.seqs[r].num_computed for r in rids)
    plan = {
        "recompute": StepPlan(recompute=rids),
        "swap": StepPlan(swap_out=rids),
        "checkpoint": StepPlan(release=rids),
        "checkpoint-sync": StepPlan(release=rids),
    }[mode]
    copy_s = e.ckpt_copier.busy_s  # NOTE: read before the release (which may wait for one)
    t0 = time.perf_counter()
    execute(e, plan)
    free_s = time.perf_counter() - t0
    assert e.allocator.num_free == e.num_kv_blocks, "blocks still held after the preemption"
    host = e.num_checkpoint_bytes if ckpt else 0
    if mode == "swap":
        host = sum(int(s.swapped_kv.nbytes) for s in e.seqs.values() if s.swapped_kv is not None)
    t0 = time.perf_counter()
    if mode != "recompute":
        execute(e, StepPlan(swap_in=rids))
    restored = sum(e.seqs[r].num_computed for r in rids)
    _until_decoding(e, out)
    resume_s = time.perf_counter() - t0
    while e.has_work():
        _collect(e.step().events, out)
    e.check_integrity()
    return Figures(
        mode=mode,
        decode_step_ms=statistics.median(steps) * 1e3,
        first_step_ms=steps[0] * 1e3,
        mean_step_ms=statistics.fmean(steps) * 1e3,
        copy_ms=copy_s * 1e3,
        free_ms=free_s * 1e3,
        resume_ms=resume_s * 1e3,
        tokens_recomputed=before - restored,
        host_bytes=host,
        equal_to_uninterrupted=out == ref,
    )


STEP_MODES = ("none", "checkpoint", "checkpoint-sync")


@dataclass
class StepFigures:
    mode: str  # none | checkpoint (background) | checkpoint-sync
    median_ms: float  # decode step, call to return
    first_ms: float  # the first: its checkpoint is the whole prompt's KV
    mean_ms: float
    mean_with_wait_ms: float  # background: + the wait for copies still running after it
    copy_ms: float  # time spent copying, in all


def step_overhead(base: TorchEngine, sc: Scenario) -> list[StepFigures]:
    """The decode steps of the same requests with no checkpoints, background and synchronous
    ones, side by side: three engines stepped in turn (the order rotating every step), so a
    change in the machine's load falls on all three alike. A background engine's copies still
    running when its step returns are waited for before the next engine steps (counted apart:
    beside a next step of its own they would overlap it)."""
    from tidal.engine.executor import execute
    from tidal.plan import StepPlan

    engines = {
        m: make_engine(base, sc, 0 if m == "none" else 1 << 40, background=m == "checkpoint")
        for m in STEP_MODES
    }
    vocab = base.model.config.vocab_size
    rids = {m: tuple(_start(e, sc, vocab)) for m, e in engines.items()}
    steps: dict[str, list[float]] = {m: [] for m in STEP_MODES}
    waits: dict[str, list[float]] = {m: [] for m in STEP_MODES}
    for i in range(sc.decode):
        for m in STEP_MODES[i % 3 :] + STEP_MODES[: i % 3]:
            e, r = engines[m], rids[m]
            t0 = time.perf_counter()
            execute(e, StepPlan(decode=r, checkpoint=() if m == "none" else r))
            t1 = time.perf_counter()
            e.wait_checkpoints()
            steps[m].append(t1 - t0)
            waits[m].append(time.perf_counter() - t1)
    return [
        StepFigures(
            mode=m,
            median_ms=statistics.median(steps[m]) * 1e3,
            first_ms=steps[m][0] * 1e3,
            mean_ms=statistics.fmean(steps[m]) * 1e3,
            mean_with_wait_ms=(statistics.fmean(steps[m]) + statistics.fmean(waits[m])) * 1e3,
            copy_ms=engines[m].ckpt_copier.busy_s * 1e3,
        )
        for m in STEP_MODES
    ]
