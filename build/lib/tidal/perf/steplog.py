"""Step logs: one JSON object per line with `tidal.engine.api.StepTelemetry`'s fields

    {"num_prefill_tokens": 512, "num_decode_tokens": 40, "num_context_tokens": 61234,
     "num_requests": 42, "step_s": 0.0731, "module_s": {}}

plus optional keys an engine may add for exact features: `num_prefill_reqs`,
`prefill_attn_pairs` (Σ new·(cached+new)), `prefill_sq_tokens` (Σ new²) and
`decode_context_tokens`. Without them: N_p = num_requests - num_decode_tokens; decode context =
num_context_tokens minus the prefill tokens (prefill chunks assumed to start from an empty cache);
pairs = S_p² / N_p (equal chunks). `synthetic_step_log` builds a log from measured dense kernel
timings plus modelled attention, for checking the fits before the engine produces real logs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tidal.perf.api import BatchShape
from tidal.perf.kernel_timings import KernelTimings


@dataclass(frozen=True)
class StepLog:
    batches: list[BatchShape]
    step_s: npt.NDArray[np.float64]
    source: str = ""

    def __len__(self) -> int:
        return len(self.batches)

    def subset(self, mask: npt.NDArray[np.bool_]) -> StepLog:
        idx = np.flatnonzero(mask)
        return StepLog([self.batches[i] for i in idx], self.step_s[idx], self.source)

    def features(self) -> tuple[npt.NDArray[np.float64], ...]:
        """HyGen Eq. 1 inputs (S_p, S_d, N_p, N_d), one entry per step."""
        b = self.batches
        return (
            np.array([x.num_prefill_tokens for x in b], dtype=np.float64),
            np.array([x.decode_context_tokens for x in b], dtype=np.float64),
            np.array([x.num_prefill_reqs for x in b], dtype=np.float64),
            np.array([x.num_decode_reqs for x in b], dtype=np.float64),
        )


def record_to_batch(r: dict[str, Any]) -> BatchShape:
    sp = int(r["num_prefill_tokens"])
    nd = int(r["num_decode_tokens"])
    n_p = int(r.get("num_prefill_reqs", max(0, int(r["num_requests"]) - nd)))
    if sp > 0:
        n_p = max(n_p, 1)
    ctx = r.get("decode_context_tokens")
    if ctx is None:
        ctx = max(0, int(r["num_context_tokens"]) - sp) if nd else 0
    pairs = r.get("prefill_attn_pairs")
    if pairs is None:
        pairs = sp * sp // max(n_p, 1)
    return BatchShape(
        num_prefill_tokens=sp,
        num_prefill_reqs=n_p,
        prefill_attn_pairs=int(pairs),
        num_decode_reqs=nd,
        decode_context_tokens=int(ctx),
        prefill_sq_tokens=int(r.get("prefill_sq_tokens", 0)),
    )


def batch_to_record(b: BatchShape, step_s: float) -> dict[str, Any]:
    return {
        "num_prefill_tokens": b.num_prefill_tokens,
        "num_decode_tokens": b.num_decode_reqs,
        "num_context_tokens": b.decode_context_tokens
        + b.prefill_attn_pairs // max(1, b.num_prefill_tokens) * b.num_prefill_reqs,
        "num_requests": b.num_prefill_reqs + b.num_decode_reqs,
        "step_s": step_s,
        "module_s": {},
        "num_prefill_reqs": b.num_prefill_reqs,
        "prefill_attn_pairs": b.prefill_attn_pairs,
        "prefill_sq_tokens": b.prefill_sq_tokens,
        "decode_context_tokens": b.decode_context_tokens,
    }


def read_step_log(path: str | Path) -> StepLog:
    batches: list[BatchShape] = []
    times: list[float] = []
    with Path(path).open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                batches.append(record_to_batch(r))
                times.append(float(r["step_s"]))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a step record ({e})") from e
    if not batches:
        raise ValueError(f"{path}: no steps")
    return StepLog(batches, np.array(times), str(path))


def write_step_log(
    path: str | Path, batches: Iterable[BatchShape], step_s: Iterable[float]
) -> None:
    with Path(path).open("w") as f:
        for b, t in zip(batches, step_s, strict=True):
            f.write(json.dumps(batch_to_record(b, float(t))) + "\n")


def synthetic_step_log(
    kt: KernelTimings,
    tp: int = 1,
    num_layers: int = 32,
    num_steps: int = 5000,
    noise: float = 0.01,
    seed: int = 0,
    attn_flops: float = 156e12,
    attn_bw: float = 1.4e12,
    overhead_s: float = 2.5e-3,
    max_decode_reqs: int = 256,
    kv_capacity_tokens: int = 110_000,
) -> StepLog:
    """Steps whose dense time is *measured*: each step's token count is one the kernel CSV has,
    and its dense part is num_layers x that row's summed token-wise operators. Attention is
    modelled (the CSVs have none): prefill 4·D·pairs/attn_flops, decode K/V bytes/attn_bw; a
    fixed per-step overhead; multiplicative lognormal noise of relative size `noise`.
    Batch mixes: 30 % decode-only, 20 % prefill-only, 50 % mixed (chunked prefill + decodes);
    at most `max_decode_reqs` decodes (vLLM's max_num_seqs) whose contexts fit in
    `kv_capacity_tokens` (Llama-2-7B on one 80 GB A100 at 90 % memory holds about 110k)."""
    rng = np.random.default_rng(seed)
    rows = np.flatnonzero(kt.tp == tp)
    if rows.size == 0:
        raise ValueError(f"no rows at tp={tp}")
    dense = np.sum(list(kt.op_s.values()), axis=0)  # (R,) seconds, one layer
    m = kt.model
    q, kv, d = m.q_dim / tp, max(m.kv_dim / tp, m.head_dim), m.bytes_per_value
    batches: list[BatchShape] = []
    times: list[float] = []
    small = rows[kt.num_tokens[rows] <= max_decode_reqs]
    for _ in range(num_steps):
        kind = rng.random()
        r = int(rng.choice(small if kind < 0.3 else rows))
        n = int(kt.num_tokens[r])
        if kind < 0.3 or n == 1:
            nd, sp = n, 0
        elif kind < 0.5:
            nd, sp = 0, n
        else:
            nd = int(rng.integers(1, min(n - 1, max_decode_reqs) + 1))
            sp = n - nd
        n_p = int(rng.integers(1, 5)) if sp else 0
        n_p = min(n_p, sp)
        cuts: npt.NDArray[np.int64] = (
            np.sort(rng.choice(np.arange(1, sp), n_p - 1, replace=False))
            if n_p > 1
            else np.zeros(0, dtype=np.int64)
        )
        chunks = np.diff(np.r_[0, cuts, sp]).astype(np.int64) if sp else np.array([], np.int64)
        cached = rng.integers(0, 2048, size=len(chunks)) * (rng.random(len(chunks)) < 0.5)
        ctx = np.minimum(rng.lognormal(6.8, 0.8, size=nd), 8192)
        room = kv_capacity_tokens - sp
        if ctx.sum() > room:  # a full cache: contexts shrink to fit, as admission would force
            ctx *= room / ctx.sum()
        ctx = np.maximum(ctx, 1).astype(np.int64)
        pairs = int(np.sum(chunks * (cached + chunks)))
        b = BatchShape(sp, n_p, pairs, nd, int(ctx.sum()), int(np.sum(chunks * chunks)))
        attn = 0.0
        if sp:
            causal = float(np.sum(chunks * cached + chunks * (chunks + 1) / 2))
            attn += 4 * q * causal / attn_flops + d * 2 * (q + kv) * sp / attn_bw
        if nd:
            attn += d * 2 * (kv * (ctx.sum() + nd) + q * nd) / attn_bw
        t = num_layers * (float(dense[r]) + attn) + overhead_s
        times.append(t * float(np.exp(rng.normal(0.0, noise))))
        batches.append(b)
    src = (
        f"synthetic: {num_layers} x measured dense kernels ({kt.source}, tp={tp})"
        f" + modelled attention, {noise:.1%} noise"
    )
    return StepLog(batches, np.array(times), src)
