"""One layer of decode attention, the native row-by-row kernel (on one thread, and split over the
two threads' team) against the torch path (gather + batched matmuls), SmolLM2's heads, bf16 and
fp32, batch 1/8/32 at 132-2,048 tokens (docs/engine.md):

    python docs/results/engine/attn_rows_vs_torch.py
"""

import time, torch, statistics
torch.set_num_threads(2)
from tidal.engine.torch import native, attention
from tidal.engine.torch.attention import AttnMeta
lib = native.load()
P = lambda t: t.data_ptr()
H, Hk, D = 9, 3, 64
for dt, sfx in ((torch.bfloat16, ""), (torch.float32, "_f32io")):
  for B, T in ((1, 300), (8, 132), (32, 132), (32, 512), (8, 2048), (32, 2048)):
    slots_n = B * T + 16
    width = (H + 2*Hk)*D
    qkv = torch.randn(B, width).to(dt)
    kc = torch.randn(slots_n, Hk, D).to(dt); vc = torch.randn(slots_n, Hk, D).to(dt)
    slots = torch.stack([torch.arange(r*T, (r+1)*T) for r in range(B)])
    lens = torch.full((B,), T, dtype=torch.int64)
    out = torch.empty(B, H*D, dtype=dt); scores = torch.empty(2*8*T)
    f = getattr(lib, "tidal_decode_attention_rows" + sfx)
    kv_rows = (slots[:, None, :] * Hk + torch.arange(Hk)[None, :, None]).reshape(-1)
    meta = AttnMeta(decode_rows=slice(0, B), decode_slots=slots, decode_bias=None, decode_kv_rows=kv_rows)
    q = qkv[:, :H*D].reshape(B, H, D).contiguous()
    def nat(n=1):
        f(P(qkv), width, P(kc), P(vc), P(slots), P(lens), T, B, H, Hk, D, 0.125, P(scores), n, P(out))
    def tor():
        attention.sdpa_paged_attention(q, kc, vc, meta, 0.125)
    res = {}
    for _ in range(3):
        for name, fn in (("native", nat), ("native-2t", lambda: nat(2)), ("torch", tor)):
            ts = []
            for _ in range(10):
                t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
            res.setdefault(name, []).append(statistics.median(ts) * 1e3)
    print(dt, B, T, {k: "%.3f ms/layer" % min(v) for k, v in res.items()}, flush=True)
