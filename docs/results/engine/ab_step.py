# median decode-step ms of one torch engine at batch B (prompts of P tokens), run from a worktree root
import sys, time, statistics, torch
torch.set_num_threads(2)
from tidal.engine.torch.loader import load_torch_engine
from tidal.engine.api import EngineRequest, SamplingParams
from tidal_bench.engine.measure import _prompts
B, P = int(sys.argv[1]), int(sys.argv[2])
e = load_torch_engine(None, device="cpu", dtype=None, kv_cache_tokens=64*256+8192, max_num_seqs=256, token_budget=512, chunk_size=512)
sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
for i, p in enumerate(_prompts(B, P, e.model.config.vocab_size)):
    e.add(EngineRequest(f"x{i}", p, sp))
while any(not s.is_decode for s in e.seqs.values()): e.step()
for _ in range(3): e.step()
ts = []
for _ in range(24):
    t0 = time.perf_counter(); e.step(); ts.append(time.perf_counter() - t0)
print(f"B={B} P={P} median step {1e3*statistics.median(ts):.2f} ms")
