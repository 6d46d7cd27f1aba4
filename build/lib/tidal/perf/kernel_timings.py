"""Reader for per-operator GPU timing CSVs (vidur's profiling format, as in
`data/gpu_kernel_timings/`): one row per (num_tokens, TP degree), per-op times in ms."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tidal.perf.catalog import ModelSpec

# Column stem -> GEMM index in roofline.layer_gemms (QKV, O, gate+up, down).
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
OTHER_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")


@dataclass(frozen=True)
class KernelTimings:
    """Measured rows; times in seconds (the CSV's median column, robust to stragglers)."""

    source: str
    model: ModelSpec  # shape from the CSV's n_head/n_kv_head/n_embd/n_expanded_embd columns
    num_tokens: npt.NDArray[np.float64]  # (R,)
    tp: npt.NDArray[np.int64]  # (R,)
    op_s: dict[str, npt.NDArray[np.float64]]  # op -> (R,) seconds

    @property
    def num_rows(self) -> int:
        return int(self.num_tokens.shape[0])

    def gemm_s(self) -> npt.NDArray[np.float64]:
        """(R, 4) seconds of the four projections, in `GEMM_OPS` order."""
        return np.stack([self.op_s[o] for o in GEMM_OPS], axis=1)

    def subset(self, mask: npt.NDArray[np.bool_]) -> KernelTimings:
        return KernelTimings(
            self.source,
            self.model,
            self.num_tokens[mask],
            self.tp[mask],
            {k: v[mask] for k, v in self.op_s.items()},
        )


def read_kernel_timings(path: str | Path, stat: str = "median") -> KernelTimings:
    """Read one CSV; duplicate (num_tokens, tp) rows are averaged."""
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")
    r0 = rows[0]
    heads, kv, hidden = int(r0["n_head"]), int(r0["n_kv_head"]), int(r0["n_embd"])
    model = ModelSpec(
        name=Path(path).stem,
        num_layers=1,
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        intermediate=int(r0["n_expanded_embd"]),
        vocab=int(r0["vocab_size"]),
        gated_mlp=r0["use_gated_mlp"].strip().lower() == "true",
    )
    ops = [o for o in (*GEMM_OPS, *OTHER_OPS) if f"time_stats.{o}.{stat}" in r0]
    acc: dict[tuple[int, int], list[list[float]]] = {}
    for r in rows:
        key = (int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))
        acc.setdefault(key, []).append([float(r[f"time_stats.{o}.{stat}"]) * 1e-3 for o in ops])
    keys = sorted(acc)
    vals = np.array([np.mean(acc[k], axis=0) for k in keys])
    return KernelTimings(
        source=str(path),
        model=model,
        num_tokens=np.array([k[0] for k in keys], dtype=np.float64),
        tp=np.array([k[1] for k in keys], dtype=np.int64),
        op_s={o: vals[:, i] for i, o in enumerate(ops)},
    )
