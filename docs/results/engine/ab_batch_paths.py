"""Batch decode paths of one torch engine, taking turns in one process (docs/engine.md):

    python docs/results/engine/ab_batch_paths.py OUT.json DTYPE BATCHES WINDOWS
    # e.g. bfloat16 8,32 5 as is; float32 8,32 5 under TIDAL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
    # ONEDNN_MAX_CPU_ISA=AVX2 (emulated AVX2)

Variants: the native decode path with its row-by-row attention (the default), the native path
with the torch path's gathered attention (as before), the torch path (`native_decode` off), and,
for an fp32 model, the native path with plain (in, out) matmuls instead of the oneDNN-packed
copies. Each window decodes 8 steps of BATCH requests with 128-token prompts; medians per variant.
"""

import json
import platform
import statistics
import sys

import torch

from tidal.engine.torch import fast_decode
from tidal.engine.torch.loader import load_torch_engine
from tidal_bench.engine.measure import engine_decode

out_path, dtype, batches, windows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(2)
eng = load_torch_engine(
    None, device="cpu", dtype=dtype, kv_cache_tokens=16384, max_num_seqs=256,
    token_budget=512, chunk_size=512,
)
m = eng.model
native, packed, rows = m.native_decode, dict(m.packed_w), fast_decode._rows


def use(nat: bool, row_attn: bool, pk: bool) -> None:
    m.native_decode = native if nat else None
    fast_decode._rows = rows if row_attn else (lambda meta: None)
    m.packed_w = packed if pk else {}


variants = {
    "native, row attention": (True, True, True),
    "native, gathered attention": (True, False, True),
    "torch path": (False, True, True),
}
if m.dtype == torch.float32:
    variants["native, row attention, plain matmuls"] = (True, True, False)
res: dict = {"dtype": str(m.dtype), "cpu": platform.processor(), "decode_tok_s": {}}
for b in [int(x) for x in batches.split(",")]:
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(windows):
        for k, v in variants.items():
            use(*v)
            runs[k].append(engine_decode(eng, b, 128, 8, 1)[0])
    res["decode_tok_s"][str(b)] = runs
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(b, {k: round(x, 1) for k, x in med.items()}, flush=True)
use(True, True, True)
with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
