# 30 SmolLM2 layers' one-row matmuls and the LM head, bf16, cold in cache (each matrix read once a
# pass): the native GEMV (`tidal.engine.torch.gemv`) against ATen's (`packed.gemv_native`), taking
# turns. Run from a tree's root with PYTHONPATH=. (and the AVX2 variables to emulate AVX2).
import statistics
import time

import torch

from tidal.engine.torch import gemv, packed

torch.set_num_threads(2)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
L = 30
ws = [[(torch.randn(o, i) * 0.02).to(torch.bfloat16) for o, i in SHAPES] for _ in range(L)]
lm = (torch.randn(49152, 576) * 0.02).to(torch.bfloat16)
xs = {i: torch.randn(1, i).to(torch.bfloat16) for _, i in SHAPES}
outs = {o: torch.empty(1, o, dtype=torch.bfloat16) for o, _ in [*SHAPES, (49152, 576)]}
nbytes = 2 * (sum(w.numel() for layer in ws for w in layer) + lm.numel())


def one_pass(fn):
    for layer in ws:
        for w in layer:
            fn(xs[w.shape[1]], w, None, out=outs[w.shape[0]])
    fn(xs[576], lm, None, out=outs[49152])


for rnd in range(3):
    for name, fn in (("aten", packed.gemv_native), ("native", gemv.gemv)):
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            one_pass(fn)
            ts.append(time.perf_counter() - t0)
        m = statistics.median(ts)
        print(f"round {rnd + 1} {name}: {1e3 * m:.2f} ms a pass, {nbytes / m / 1e9:.1f} GB/s")
