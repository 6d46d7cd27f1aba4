"""`tidal bench engine`: throughput of the real torch engine beside HF `transformers` and the
memory-bandwidth roofline.

    tidal bench engine [--json PATH] [--batches 1,8,32,64] [--prefill 512,2048] [--no-hf]
    tidal bench engine --device cuda --shape qwen2.5-7b     # random weights, Qwen2.5-7B's shape

Decode tokens/s at each batch size (prompts of --prompt-len tokens, --decode-steps timed steps),
prefill tokens/s at each prompt length (one chunk), each beside HF `generate` on the same model,
dtype and thread count, and beside the roofline: bytes one step moves (weights + KV read) divided
by the copy bandwidth measured with a large torch copy. Also the time from `request_preempt()`
to the engine being free during a long prefill (OOCO §3.4.1). Figures come from a real engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.llama import LlamaModel
from tidal.engine.model_config import ModelConfig
from tidal.engine.torch_engine import EngineConfig, TorchEngine, default_dtype, load_torch_engine

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
    """Bytes/s of a large tensor copy (read + write both counted)."""
    n = mib * (1 << 20) // 4
    a = torch.ones(n, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * a.element_size() / min(times)


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids from the middle of the vocabulary: ordinary text tokens, never a special token
    return torch.randint(1000, min(vocab, 30000), (batch, length), generator=g).tolist()


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
            while not engine._in_step:  # wait for the step to start, then cut it mid-way
                time.sleep(0.0005)
            time.sleep(step_s * 0.15)  # early: a busy machine can make the step much faster
            engine.request_preempt()

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
    """Bytes one decode step must move: every weight once, plus each request's KV."""
    mc = engine.model.config
    kv = 2 * mc.num_hidden_layers * mc.kv_size * engine.kv.element_size() * ctx * batch
    return engine.model.weight_bytes() + kv


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(x) for x in args.batches.split(",") if x]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    res: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads()}
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("loading", total=3 + len(batches) + len(prefills))
        if args.shape == "qwen2.5-7b":
            dt = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
            engine = random_engine(QWEN25_7B, device, dt)
            hf_dir = None
        else:
            engine = load_torch_engine(
                args.model,
                device=args.device,
                dtype=args.dtype,
                kv_cache_tokens=args.kv_tokens,
                max_num_seqs=256,
                token_budget=max([*prefills, 512]),
                chunk_size=max([*prefills, 512]),
            )
            from tidal.engine.weights import embedded_model_path, load_checkpoint

            path = embedded_model_path() if args.model is None else Path(args.model)
            hf_dir = load_checkpoint(path)[3]
        res["model"] = engine.model_name
        res["dtype"] = str(engine.model.dtype).removeprefix("torch.")
        prog.update(task, advance=1, description="copy bandwidth")
        bw = copy_bandwidth(device)
        res["copy_bandwidth_gb_s"] = bw / 1e9
        hf = None
        if hf_dir is not None and not args.no_hf:
            prog.update(task, description="loading HF transformers")
            hf = HFGenerate(hf_dir, engine.model.dtype, engine.model.config.vocab_size)
        ctx = args.prompt_len + args.decode_steps // 2 + 2
        dec, hf_dec, roof, step_ms = {}, {}, {}, {}
        for b in batches:
            prog.update(task, advance=1, description=f"decode batch {b}")
            between = (
                None if hf is None else lambda b=b: hf.decode(b, args.prompt_len, args.decode_steps)
            )
            tps, hf_tps = engine_decode(
                engine, b, args.prompt_len, args.decode_steps, args.rounds, between
            )
            dec[str(b)] = tps
            step_ms[str(b)] = 1e3 * b / tps
            roof[str(b)] = b / (step_bytes(engine, b, ctx) / bw)
            if hf_tps is not None:
                hf_dec[str(b)] = hf_tps
        pre, hf_pre = {}, {}
        for n in prefills:
            prog.update(task, advance=1, description=f"prefill {n}")
            engine_prefill(engine, n, run=99)  # warm-up
            pre[str(n)] = max(engine_prefill(engine, n, r) for r in range(args.rounds))
            if hf is not None:
                hf_pre[str(n)] = max(hf.prefill(n, r) for r in range(args.rounds))
        res |= {
            "decode_tokens_per_s": dec,
            "decode_step_ms": step_ms,
            "roofline_decode_tokens_per_s": roof,
            "prefill_tokens_per_s": pre,
            "roofline_decode_step_ms": {
                str(b): 1e3 * step_bytes(engine, b, ctx) / bw for b in batches
            },
        }
        if hf is not None:
            res["hf"] = {"decode": hf_dec, "prefill": hf_pre}
        prog.update(task, advance=1, description="preemption latency")
        res["preemption"] = preempt_latency(engine, max([*prefills, 512]))
    _report(console, res, batches, prefills)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _report(console: Any, res: dict[str, Any], batches: list[int], prefills: list[int]) -> None:
    from rich.table import Table

    hf = res.get("hf", {"decode": {}, "prefill": {}})
    t = Table(
        title=f"torch engine (real) — {res['model']} {res['dtype']} on {res['device']}, "
        f"{res['threads']} threads, copy bandwidth {res['copy_bandwidth_gb_s']:.1f} GB/s"
    )
    for c in ("phase", "size", "tidal tok/s", "HF tok/s", "× HF", "roofline tok/s", "% roofline"):
        t.add_column(c, justify="right")

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}"

    for b in batches:
        k = str(b)
        ours, theirs, roof = (
            res["decode_tokens_per_s"][k],
            hf["decode"].get(k),
            res["roofline_decode_tokens_per_s"][k],
        )
        t.add_row(
            "decode",
            f"batch {b}",
            fmt(ours),
            fmt(theirs),
            "-" if theirs is None else f"{ours / theirs:.2f}",
            fmt(roof),
            f"{100 * ours / roof:.0f} %",
        )
    for n in prefills:
        k = str(n)
        ours, theirs = res["prefill_tokens_per_s"][k], hf["prefill"].get(k)
        t.add_row(
            "prefill",
            f"{n} tokens",
            fmt(ours),
            fmt(theirs),
            "-" if theirs is None else f"{ours / theirs:.2f}",
            "-",
            "-",
        )
    console.print(t)
    pm = res["preemption"]
    console.print(
        f"preempt signal -> engine free: {pm['preempt_to_free_ms']:.2f} ms "
        f"(one layer of a {max([*prefills, 512])}-token prefill: {pm['layer_ms']:.2f} ms)"
    )
    d = res["decode_tokens_per_s"]
    checks = {}
    if "1" in d and "1" in hf["decode"]:
        checks["batch1_vs_hf"] = d["1"] / hf["decode"]["1"]
    if "1" in d:
        checks["batch1_pct_roofline"] = 100 * d["1"] / res["roofline_decode_tokens_per_s"]["1"]
    if "32" in d and "8" in hf["decode"]:
        checks["batch32_vs_hf_batch8"] = d["32"] / hf["decode"]["8"]
    res["targets"] = checks
    for k, v, goal in (
        ("batch1_vs_hf", checks.get("batch1_vs_hf"), 1.2),
        ("batch1_pct_roofline", checks.get("batch1_pct_roofline"), 70.0),
        ("batch32_vs_hf_batch8", checks.get("batch32_vs_hf_batch8"), 4.0),
    ):
        if v is not None:
            console.print(
                f"target {k}: {v:.2f} (goal >= {goal}) {'met' if v >= goal else 'MISSED'}"
            )


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--shape",
        default="",
        choices=["", "qwen2.5-7b"],
        help="random weights of this shape instead of --model (no HF comparison)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: auto)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--prefill", default="512,2048", help="prefill lengths")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens before decode")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; best one counts")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--kv-tokens", type=int, default=64 * 256 + 8192, help="KV cache tokens")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run_bench)


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `engine` under an existing `tidal bench` parser."""
    p = bench_subparsers.add_parser(
        "engine",
        help="torch engine throughput vs HF and roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_args(p)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Standalone: add `bench engine` (when no other module owns `bench`)."""
    p = subparsers.add_parser("bench", help="benchmarks")
    register_bench(p.add_subparsers(dest="bench_cmd", required=True))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tidal bench engine", description=__doc__)
    _add_args(parser)
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
