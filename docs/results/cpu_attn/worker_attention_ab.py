"""A/B of KvStore.attend on core 1 (one thread): `PYTHONPATH=<tree> python worker_attention_ab.py <label>`
with <tree> the code before (git archive df95804) or after; one JSON line per case."""
import json, sys, statistics, time
import torch
from tidal_bench.cpu_attn.bound import measure, on_cores, SMOLLM2_135M, ITEM_BYTES
from tidal.cpu_attn.kv_store import KvStore
label = sys.argv[1]
for dtype in ("bfloat16", "float32"):
    r = measure((1,), 24, 400, dtype)
    print(json.dumps({"label": label, "case": "24x400", **r}), flush=True)
# mixed lengths 100..1000 (24 rows), bf16, same cores, same bound formula
with on_cores((1,)):
    from tidal_bench.cpu_attn.bound import copy_gb_per_s
    bw = copy_gb_per_s()
    for dtype in ("bfloat16", "float32"):
        dt = getattr(torch, dtype); geo = SMOLLM2_135M
        H, Hk, D = geo.num_heads, geo.num_kv_heads, geo.head_dim
        lens = [100 + (i * 383) % 900 for i in range(24)]
        st = KvStore(1 << 34); ids = [f"r{i}" for i in range(24)]
        for rid, T in zip(ids, lens):
            st.put(rid, torch.randn(1, 2, T, Hk, D).to(dt), reserve_tokens=21)
        ts, cs = [], []
        for step in range(20):
            qkv = torch.randn(24, H + 2 * Hk, D).to(dt)
            t0, c0 = time.perf_counter(), time.thread_time()
            st.attend(0, ids, [T + step for T in lens], qkv, H, D**-0.5)
            ts.append(time.perf_counter() - t0); cs.append(time.thread_time() - c0)
        kvb = sum(T + 10 for T in lens) * geo.kv_bytes_per_token_layer(ITEM_BYTES[dtype])
        bound = kvb / (bw * 1e9)
        print(json.dumps({"label": label, "case": "24 mixed 100-1000", "cores": "1", "copy_gb_per_s": round(bw, 2), "dtype": dtype,
              "us_per_frame": round(1e6 * statistics.median(ts), 1), "cpu_us_per_frame": round(1e6 * statistics.median(cs), 1),
              "kv_kb_per_frame": round(kvb / 1e3, 1), "bound_us_per_frame": round(1e6 * bound, 1),
              "x_bound": round(statistics.median(ts) / bound, 2)}), flush=True)
