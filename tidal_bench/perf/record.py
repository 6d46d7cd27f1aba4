"""Record a real step log from the `torch` engine (HyGen §4.2: "training data ... collected by
systematically profiling target hardware across diverse batch compositions").

Drives the engine with explicit random plans (how many decodes, how large a prefill chunk) over a
changing request population, so the log covers decode-only, prefill-only and mixed steps over a
range of batch sizes and contexts (`populations`: how many requests are in the engine, a new
draw every 40 steps; each step decodes a random share of them, so the largest decode batches
reach the largest population). The engine itself appends each step to the log (its
`EngineConfig.step_log`). With `clock="wall"` the machine's load is part of what gets
measured; on a shared machine `clock="thread"` logs the stepping thread's CPU time instead (with
one torch thread all the compute runs on it), keeping the wall time as `wall_s`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

POPULATIONS = (1, 2, 4, 8, 16, 32, 48)  # requests in the engine, one drawn every 40 steps


def record_engine_log(
    out: str,
    num_steps: int = 1500,
    model: str | None = None,
    device: str = "cpu",
    threads: int | None = 1,
    seed: int = 0,
    max_prompt: int = 384,
    max_output: int = 64,
    chunks: tuple[int, ...] = (0, 16, 32, 64, 128, 256),
    clock: str = "wall",
    progress: Callable[[int], None] | None = None,
    populations: tuple[int, ...] = POPULATIONS,
    kv_cache_tokens: int = 65536,
) -> int:
    """Run `num_steps` planned steps, appending them to `out`; returns the steps recorded."""
    if clock not in ("wall", "thread"):
        raise ValueError(f"clock must be 'wall' or 'thread', got {clock!r}")
    if not populations or min(populations) < 1:
        raise ValueError(f"populations must be >= 1 requests each, got {populations}")
    if max(populations) * (max_prompt + max_output) > kv_cache_tokens:
        raise ValueError(
            f"{max(populations)} requests of up to {max_prompt} + {max_output} tokens need more "
            f"than the {kv_cache_tokens} KV tokens: lower the populations or raise the KV"
        )
    if clock == "thread" and threads != 1:
        raise ValueError("clock='thread' measures one thread: use threads=1")
    import torch

    from tidal.engine.api import EngineRequest, SamplingParams
    from tidal.engine.torch.loader import load_torch_engine
    from tidal.plan import StepPlan

    if threads:
        torch.set_num_threads(threads)  # NOTE: oversubscribed threads make CPU steps erratic
    log_path = out if clock == "wall" else out + ".wall.tmp"
    if clock == "thread":
        Path(log_path).unlink(missing_ok=True)
    eng = load_torch_engine(
        model, device=device, step_log=log_path, kv_cache_tokens=kv_cache_tokens
    )
    cpu_s: list[float] = []
    rng = np.random.default_rng(seed)
    target, next_id = 1, 0
    for i in range(num_steps):
        if i % 40 == 0:  # a new population size every 40 steps
            target = int(rng.choice(populations))
        views = eng.schedulable()
        while len(views) < target:
            prompt = rng.integers(1, 32000, int(rng.integers(8, max_prompt + 1))).tolist()
            sp = SamplingParams(max_tokens=int(rng.integers(1, max_output + 1)), ignore_eos=True)
            eng.add(EngineRequest(f"r{next_id}", prompt, sp))
            next_id += 1
            views = eng.schedulable()
        plan: dict[str, int] = {v.req_id: v.forced_tokens for v in views if v.forced_tokens}
        decodes = [v for v in views if v.is_decode and v.req_id not in plan]
        waiting = [v for v in views if not v.is_decode and v.req_id not in plan]
        nd = int(rng.integers(0, len(decodes) + 1)) if decodes else 0
        for v in decodes[:nd]:
            plan[v.req_id] = 1
        chunk = int(rng.choice(chunks)) if waiting else 0
        for v in sorted(waiting, key=lambda v: v.arrival_s):
            if chunk <= 0:
                break
            n = min(chunk, v.num_pending)
            plan[v.req_id] = n
            chunk -= n
        if not plan:
            v = views[0]
            plan[v.req_id] = 1 if v.is_decode else min(64, v.num_pending)
        t0 = time.thread_time()
        eng.step(StepPlan(prefill=plan))
        cpu_s.append(time.thread_time() - t0)
        if progress:
            progress(i + 1)
    if clock == "thread":
        del eng  # closes its log
        lines = Path(log_path).read_text().splitlines()
        Path(log_path).unlink()
        with Path(out).open("a") as f:
            for line, t in zip(lines, cpu_s, strict=True):
                r = json.loads(line)
                r["wall_s"], r["step_s"] = r["step_s"], t
                f.write(json.dumps(r) + "\n")
    return num_steps
