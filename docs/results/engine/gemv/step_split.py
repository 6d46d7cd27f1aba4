# where a lone decode step's wall time goes (perf_counter wrappers, no profiler); run from a tree's root:
# PYTHONPATH=. python docs/results/engine/gemv/step_split.py BATCH PROMPT_TOKENS
import sys, time, statistics, torch, collections
torch.set_num_threads(2)
from tidal.engine.torch.loader import load_torch_engine
from tidal.engine.api import EngineRequest, SamplingParams
from tidal_bench.engine.measure import _prompts
from tidal.engine.torch import runner as R, llama as L
B, P = int(sys.argv[1]), int(sys.argv[2])
e = load_torch_engine(None, device="cpu", dtype=None, kv_cache_tokens=64*256+8192, max_num_seqs=256, token_budget=512, chunk_size=512)
acc = collections.defaultdict(list)
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); acc[label].append(time.perf_counter() - t0); return r
    setattr(obj, name, g)
wrap(e.runner, "_build", "build")
wrap(e.runner.model, "forward_layers", "layers")
wrap(e.runner, "_sample", "sample")
wrap(e.runner.model, "logits", "logits")
wrap(e.runner, "run", "run")
sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
for i, p in enumerate(_prompts(B, P, e.model.config.vocab_size)):
    e.add(EngineRequest(f"x{i}", p, sp))
while any(not s.is_decode for s in e.seqs.values()): e.step()
for _ in range(3): e.step()
acc.clear(); ts = []
for _ in range(40):
    t0 = time.perf_counter(); e.step(); ts.append(time.perf_counter() - t0)
print(f"B={B} P={P} step {1e3*statistics.median(ts):.2f} ms; " + ", ".join(f"{k} {1e3*statistics.median(v):.3f}" for k, v in acc.items()))
