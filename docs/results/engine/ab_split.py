"""The per-shape weight A/B of ../../engine.md: fp32, fp32 with bf16 copies up to 8 rows, bf16
engines in one process, decode windows of 16 steps taking turns at each batch, then 512-token
prefills taking turns. Run from the repository root:

    TIDAL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
      PYTHONPATH=. python docs/results/engine/ab_split.py OUT.json 1,8,32 3 'fp32,fp32+bf16<=8'
(args: output, batches, windows per batch, engines that also run the prefill)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from tidal.engine.torch.loader import load_torch_engine
from tidal_bench.engine.measure import copy_bandwidth, engine_decode, engine_prefill, step_bytes

torch.set_num_threads(2)
variants = {"fp32": ("float32", 0), "fp32+bf16<=8": ("float32", 8), "bf16": ("bfloat16", 0)}
engines = {
    k: load_torch_engine(
        None,
        dtype=d,
        bf16_weight_rows=r,
        kv_cache_tokens=8192,
        max_num_seqs=64,
        token_budget=512,
        chunk_size=512,
    )
    for k, (d, r) in variants.items()
}
bw = copy_bandwidth(torch.device("cpu"))
res: dict = {"copy_bandwidth_gb_s": bw / 1e9, "windows": {}}
for b in [int(x) for x in sys.argv[2].split(",")]:
    tps: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(int(sys.argv[3])):
        for k, e in engines.items():
            tps[k].append(engine_decode(e, b, 64, 16, 1)[0])
    res["windows"][str(b)] = tps
    for k, v in tps.items():
        roof = b / (step_bytes(engines[k], b, 74) / bw)
        med = statistics.median(v)
        print(f"b{b} {k:14s} median {med:7.1f} tok/s ({100 * med / roof:.0f} % of {roof:.0f})")
pre: dict[str, list[float]] = {k: [] for k in engines}
for r in range(2):
    for k, e in engines.items():
        if k in sys.argv[4].split(","):
            pre[k].append(engine_prefill(e, 512, r))
res["prefill_512"] = pre
for k, v in pre.items():
    if v:
        print(f"prefill 512 {k:14s} best {max(v):7.1f} tok/s  runs {[round(x, 1) for x in v]}")
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
