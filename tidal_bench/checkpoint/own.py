"""`tidal bench checkpoint --own`: the engines' own eviction (no policy plan) with and without a
checkpoint budget. N offline requests decode `decode` tokens under the engine's own planner
(which, with a budget, checkpoints them in the background by itself); then an online request
whose prompt needs half the KV pool arrives, the own planner evicts offline work for it (with
checkpoints: releases, else recomputes), and everything runs to the end. Per budget: requests
evicted and how, eviction time (call to blocks free, mean), KV tokens recomputed, the host
memory the checkpoints held at their peak, the online request's first token (from its arrival),
and the time until every request finished. The torch engine's figures are wall time (measured);
the sim engine's are its emulated step times (the host copies cost it nothing: emulated)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal_bench.checkpoint.engine import Scenario, _collect, _start, make_engine

if TYPE_CHECKING:
    from tidal.engine.torch.engine import TorchEngine


@dataclass
class OwnFigures:
    mode: str  # "checkpoint" | "recompute"
    releases: int
    recomputes: int
    evict_ms: float  # mean, call to blocks free
    tokens_recomputed: int
    host_bytes_peak: int
    online_ttft_ms: float
    finish_s: float  # online arrival -> every request finished
    equal_to_uninterrupted: bool | None  # greedy tokens of the offline requests (torch only)


def _online(sc: Scenario, vocab: int, pool: int) -> Any:
    import torch

    from tidal.engine.api import EngineRequest, RequestClass, SamplingParams

    g = torch.Generator().manual_seed(40)
    prompt = torch.randint(100, vocab, (pool // 2,), generator=g).tolist()
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return EngineRequest("online", prompt, sp, RequestClass.ONLINE, 1e9)


def measure_torch(
    base: TorchEngine, sc: Scenario, ckpt: bool, ref: dict[str, list[int]]
) -> OwnFigures:
    e = make_engine(base, sc, 1 << 40 if ckpt else 0)
    vocab = base.model.config.vocab_size
    out = _start(e, sc, vocab)
    peak = 0
    for _ in range(sc.decode):
        _collect(e.step().events, out)
        peak = max(peak, e.num_checkpoint_bytes)
    out["online"] = []
    e.add(_online(sc, vocab, e.num_kv_blocks * e.block_size))
    t0 = time.perf_counter()
    ttft = 0.0
    while e.has_work():
        _collect(e.step().events, out)
        peak = max(peak, e.num_checkpoint_bytes)
        if not ttft and out["online"]:
            ttft = time.perf_counter() - t0
    finish = time.perf_counter() - t0
    e.check_integrity()
    del out["online"]
    return OwnFigures(
        mode="checkpoint" if ckpt else "recompute",
        releases=e.num_checkpoint_releases,
        recomputes=e.num_recompute_preemptions,
        evict_ms=e.own_evict_s / max(1, e.num_own_evictions) * 1e3,
        tokens_recomputed=e.num_checkpoint_lost_tokens + e.num_recompute_lost_tokens,
        host_bytes_peak=peak,
        online_ttft_ms=ttft * 1e3,
        finish_s=finish,
        equal_to_uninterrupted=out == ref,
    )


def measure_sim(sc: Scenario, ckpt: bool, model: str, hardware: str) -> OwnFigures:
    """The same on the sim engine, emulated step times of `model` on `hardware`."""
    import torch

    from tidal.engine.api import EngineRequest, RequestClass, SamplingParams
    from tidal.engine.sim.engine import SimEngine, SimEngineConfig
    from tidal.perf import kv_bytes_per_token, make_step_model, model_spec

    kvb = int(kv_bytes_per_token(model_spec(model), 1))
    per_req = sc.context + sc.decode + sc.after + 2 * sc.block_size
    blocks = sc.num_requests * -(-per_req // sc.block_size)
    cfg = SimEngineConfig(
        block_size=sc.block_size, num_kv_blocks=blocks, max_model_len=blocks * sc.block_size,
        max_batch_tokens=max(512, sc.context), chunk_size=max(512, sc.context),
        kv_bytes_per_token=kvb, tokenizer="bytes",
        checkpoint_host_bytes=1 << 40 if ckpt else 0,
    )  # fmt: skip
    e = SimEngine(cfg, make_step_model(model, hardware))
    g = torch.Generator().manual_seed(39)
    sp = SamplingParams(max_tokens=sc.decode + sc.after + 1, ignore_eos=True)
    for i in range(sc.num_requests):
        p = torch.randint(1, 250, (sc.context,), generator=g).tolist()
        e.add(EngineRequest(f"off{i}", p, sp, RequestClass.OFFLINE, float(i)))
    peak = 0
    while min((s.num_output for s in e.seqs.values()), default=0) < sc.decode:
        e.step()
        peak = max(peak, e.num_checkpoint_bytes)
    online = _online(sc, 250, blocks * sc.block_size)
    e.add(online)
    now = ttft = 0.0
    while e.has_work():
        res = e.step()
        now += res.telemetry.step_s
        peak = max(peak, e.num_checkpoint_bytes)
        if not ttft and any(ev.req_id == "online" for ev in res.events):
            ttft = now
    e.check_integrity()
    return OwnFigures(
        mode="checkpoint" if ckpt else "recompute",
        releases=e.num_checkpoint_releases,
        recomputes=e.num_recompute_preemptions,
        evict_ms=0.0,  # emulated: a release or a recompute frees blocks in no time
        tokens_recomputed=e.num_checkpoint_lost_tokens + e.num_recompute_lost_tokens,
        host_bytes_peak=peak,
        online_ttft_ms=ttft * 1e3,
        finish_s=now,
        equal_to_uninterrupted=None,  # emulated tokens: nothing to check
    )
