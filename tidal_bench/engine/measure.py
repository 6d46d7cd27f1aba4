"""Measurements behind `tidal bench engine`: engine and HF `transformers` throughput, copy
bandwidth, bytes per decode step (roofline), and preemption latency."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch.engine import TorchEngine
from tidal.engine.torch.engine_config import EngineConfig
from tidal.engine.torch.llama import LlamaModel
from tidal.engine.torch.model_config import ModelConfig

QWEN25_7B = ModelConfig(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=32768,
    rope_theta=1e6,
    attention_bias=True,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, mib: int = 512) -> float:
    """Bytes/s of a large tensor copy (read + write both counted, as STREAM's Copy)."""
    return _best_of_threads(device, lambda: _copy_bandwidth(device, mib))


def read_bandwidth(device: torch.device, mib: int = 512, probes: int = 3) -> list[float]:
    """Bytes/s of reading a large tensor (its sum: one add per 4 bytes read, far below what a
    core computes), the rate a decode step's weights and KV can stream at: it reads them and
    writes next to nothing. `probes` readings, each on a new tensor: on a shared VM one reading
    in three or four came out 50-60 % above the rest (53 against 30-35 GB/s), so the roofline
    takes the median of many."""
    return [_best_of_threads(device, lambda: _read_bandwidth(device, mib)) for _ in range(probes)]


def _best_of_threads(device: torch.device, probe: Callable[[], float]) -> float:
    """On CPU the best of the current thread count and one thread (one core's stream often
    beats two on a small machine, and the roofline should be the machine's, not the thread
    setting's)."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        return probe()
    n = torch.get_num_threads()
    best = probe()
    torch.set_num_threads(1)
    try:
        return max(best, probe())
    finally:
        torch.set_num_threads(n)


def _best_time(device: torch.device, fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _copy_bandwidth(device: torch.device, mib: int) -> float:
    n = mib * (1 << 20) // 4
    a = torch.ones(n, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * a.element_size() / _best_time(device, lambda: b.copy_(a))


def _read_bandwidth(device: torch.device, mib: int) -> float:
    a = torch.ones(mib * (1 << 20) // 4, device=device)
    return a.numel() * a.element_size() / _best_time(device, a.sum)


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids from the middle of the vocabulary: ordinary text tokens, never a special token
    lo = min(1000, vocab // 4)  # a tiny test vocabulary has no "middle" past 1000
    return torch.randint(lo, min(vocab, 30000), (batch, length), generator=g).tolist()


def engine_decode(
    engine: TorchEngine,
    batch: int,
    prompt_len: int,
    steps: int,
    rounds: int = 1,
    between: Callable[[], float] | None = None,
) -> tuple[float, float | None]:
    """Decode tokens/s with `batch` requests in flight (prefill excluded), best of `rounds`
    windows of `steps` steps; `between()` (the HF figure) runs after each window, so both are
    sampled under the same load on a shared machine. Returns (ours, best of `between`)."""
    sp = SamplingParams(max_tokens=rounds * (steps + 1) + 4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt_len, engine.model.config.vocab_size)):
        engine.add(EngineRequest(f"d{batch}-{i}", p, sp))
    while any(not s.is_decode for s in engine.seqs.values()):
        engine.step()
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        engine.step()  # a warm step after whatever ran in between
        times = []
        for _ in range(steps):
            _sync(engine.model.device)
            t0 = time.perf_counter()
            engine.step()
            _sync(engine.model.device)
            times.append(time.perf_counter() - t0)
        # NOTE: median step, so a burst from another process does not count
        ours.append(batch / statistics.median(times))
        if between is not None:
            theirs.append(between())
    for rid in list(engine.seqs):
        engine.abort(rid)
    return max(ours), (max(theirs) if theirs else None)


def engine_prefill(engine: TorchEngine, length: int, run: int) -> float:
    """Tokens/s of one `length`-token prefill (a new prompt per `run`: no prefix-cache hit)."""
    (p,) = _prompts(1, length, engine.model.config.vocab_size, seed=10 * length + run)
    engine.add(EngineRequest(f"p{length}-{run}", p, SamplingParams(max_tokens=1)))
    _sync(engine.model.device)
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    _sync(engine.model.device)
    return length / (time.perf_counter() - t0)


def preempt_latency(engine: TorchEngine, length: int, reps: int = 5) -> dict[str, float]:
    """Signal a preemption from another thread while a `length`-token prefill runs; the time
    from the signal until `step()` returns (engine free), median of `reps` tries."""
    (p,) = _prompts(1, length, engine.model.config.vocab_size, seed=7)
    engine.add(EngineRequest("pre", p, SamplingParams(max_tokens=1)))
    t0 = time.perf_counter()
    engine.step()  # an uninterrupted step of the same size, for the per-layer time
    step_s = time.perf_counter() - t0
    engine.abort("pre")
    lats = []
    for r in range(reps):
        # a new prompt each time: a repeated one would be served by the prefix cache
        (p,) = _prompts(1, length, engine.model.config.vocab_size, seed=8 + r)
        engine.add(EngineRequest("pre", p, SamplingParams(max_tokens=1)))

        def signal() -> None:
            while not engine.preemption.in_step:  # wait for the step to start, then cut it mid-way
                time.sleep(0.0005)
            time.sleep(step_s * 0.15)  # early: a busy machine can make the step much faster
            engine.request_layer_cut()

        th = threading.Thread(target=signal)
        th.start()
        engine.step()
        th.join()
        if engine.last_step_preempted and engine.last_preempt_latency_s is not None:
            lats.append(engine.last_preempt_latency_s)
        engine.abort("pre")
    return {
        "preempt_to_free_ms": 1e3 * statistics.median(lats) if lats else float("nan"),
        "preempt_to_free_max_ms": 1e3 * max(lats) if lats else float("nan"),
        "prefill_step_ms": 1e3 * step_s,
        "layer_ms": 1e3 * step_s / engine.model.config.num_hidden_layers,
    }


class HFGenerate:
    """HF `transformers` `generate` on the same checkpoint, dtype and threads."""

    def __init__(self, hf_dir: Path, dtype: torch.dtype, vocab: int) -> None:
        from transformers import AutoModelForCausalLM, StoppingCriteria

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        self.vocab = vocab

        class Stamp(StoppingCriteria):  # called once per generated token: times each step
            def __init__(self) -> None:
                self.t: list[float] = []

            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                self.t.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        self.stamp_cls = Stamp
        self.gen(_prompts(1, 16, vocab), 2)  # warm-up

    def gen(self, ids: list[list[int]], new: int) -> tuple[float, float]:
        """(seconds to the first token, median seconds per later token)"""
        from transformers import StoppingCriteriaList

        x = torch.tensor(ids)
        stamp = self.stamp_cls()
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([stamp]),
            )
        steps = [b - a for a, b in zip(stamp.t[1:], stamp.t[2:], strict=False)]
        return stamp.t[0] - t0, statistics.median(steps) if steps else float("nan")

    def decode(self, batch: int, prompt_len: int, steps: int) -> float:
        return batch / self.gen(_prompts(batch, prompt_len, self.vocab), steps + 2)[1]

    def prefill(self, length: int, run: int) -> float:
        (p,) = _prompts(1, length, self.vocab, seed=10 * length + run)
        return length / self.gen([p], 1)[0]


def random_engine(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> TorchEngine:
    """Random weights of `cfg`'s shape, made on the device (nothing loaded)."""
    from tidal.engine.tokenizer import TidalTokenizer

    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    state = {k: torch.randn(s, device=device, dtype=dtype) * 0.02 for k, s in shapes.items()}
    model = LlamaModel(cfg, state, device, dtype)
    del state
    from tokenizers import Tokenizer, models

    tok = TidalTokenizer(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), None, None)
    return TorchEngine(
        model,
        tok,
        "random-qwen2.5-7b",
        EngineConfig(kv_cache_tokens=64 * 2048 + 4096, max_num_seqs=256),
    )


def step_bytes(engine: TorchEngine, batch: int, ctx: int) -> int:
    """Bytes one decode step must move: every weight once (the bf16 copies where they serve
    `batch` rows, `small_rows`), plus each request's KV."""
    mc = engine.model.config
    kv = 2 * mc.num_hidden_layers * mc.kv_size * engine.kv.element_size() * ctx * batch
    return engine.model.weight_bytes(rows=batch) + kv
