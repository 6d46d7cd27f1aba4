"""`tidal bench dtype`: the torch engine's dtype calibration, run afresh (no cache) several times
on this CPU, each run's bf16/fp32 time ratios and pick. Stable picks are the point: a choice that
flips between runs is chance. With `TIDAL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2` it answers as on an AVX2-only CPU (docs/engine.md)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tidal_bench.kit import save_json

if TYPE_CHECKING:
    from tidal.engine.torch.model_config import ModelConfig


def model_config(model: str) -> ModelConfig:
    """The config of an HF directory or GGUF file ("" = the embedded SmolLM2)."""
    from tidal.engine.torch.model_config import ModelConfig
    from tidal.engine.torch.weights import embedded_model_path, gguf_to_hf_dir

    path = Path(model) if model else embedded_model_path()
    hf = gguf_to_hf_dir(path) if path.is_file() else path
    return ModelConfig.from_hf_dict(json.loads((hf / "config.json").read_text()))


def run(args: argparse.Namespace) -> int:
    # NOTE: torch on demand: `tidal bench --help` and the other benchmarks run without it
    import torch

    from tidal.engine.torch import cpu_caps, dtype_choice

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_config(args.model)
    print(f"cpu: {cpu_caps.probe().summary()}; {torch.get_num_threads()} threads; "
          f"rows {dtype_choice.BATCHES}")  # fmt: skip
    runs: list[dict[str, object]] = []
    for i in range(args.runs):
        t0 = time.perf_counter()
        choice = dtype_choice.measure_candidates(cfg)
        took_s = time.perf_counter() - t0
        runs.append({"dtype": choice.dtype, "seconds": took_s, "reason": choice.reason})
        print(f"run {i}: {choice.dtype:9s} in {took_s:4.1f} s; {choice.reason}")
    picks = {str(r["dtype"]) for r in runs}
    print(f"picks: {', '.join(sorted(picks))} ({'stable' if len(picks) == 1 else 'UNSTABLE'})")
    save_json(args.json, {"cpu": cpu_caps.probe().summary(), "runs": runs})
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("dtype", help="the torch engine's dtype calibration, several fresh runs",
                         description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="", help="HF directory or GGUF (default: embedded SmolLM2)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.set_defaults(func=run)
