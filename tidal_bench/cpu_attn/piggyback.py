"""The instance side of attention piggybacking, timed on the engine alone (`tidal bench cpu-attn
--overhead`): for each number of offloaded requests, SmolLM2's engine offloads that many short
decodes to a worker on this machine and runs steps of them alone; the residual store and queue
work per layer (`Piggyback.overhead_s`: gathering the rows entering a layer, filing q/k/v,
taking back the outputs that arrived, and putting each row's residual back) is divided by the
layers, beside OmniServe §5.3's <= 75 us (queues, residual store) and ~0.5 ms (out-of-order
residual loads) at 400 requests."""

from __future__ import annotations

import statistics
from typing import Any

from rich.progress import Progress

from services.cpu_attn.server import ThreadedWorker
from services.instance.cpu_attn_link import CpuAttnPool
from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch.loader import load_torch_engine
from tidal.plan import StepPlan

STEPS = 6


def overhead_table(row_counts: list[int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Progress() as bar:
        task = bar.add_task("piggyback overhead", total=len(row_counts))
        for n in row_counts:
            rows.append(_measure(n))
            bar.advance(task)
    print("  offloaded rows  overhead us/layer (median of steps)  wire B/layer/row (up+down)")
    for r in rows:
        print(f"  {r['rows']:14d}  {r['overhead_us_per_layer']:34.1f}  {r['wire_bytes_per_row']}")
    return rows


def _measure(n: int) -> dict[str, Any]:
    worker = ThreadedWorker(8 << 30)
    pool = CpuAttnPool()
    try:
        engine = load_torch_engine(None, kv_cache_tokens=max(4096, 40 * n), max_num_seqs=n)
        engine.attach_cpu_attn(pool)
        pool.connect("w0", "127.0.0.1", worker.port)
        sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for i in range(n):
            engine.add(EngineRequest(f"r{i}", engine.tokenizer.encode(f"{i} tide wave"), sp))
        while any(s.num_output == 0 for s in engine.seqs.values()):
            engine.step()
        for rid in list(engine.seqs):
            engine.offload(rid)
        ids = tuple(engine.seqs)
        for _ in range(STEPS):
            engine.step(StepPlan(cpu_decode=ids))
        L = engine.model.config.num_hidden_layers
        per_layer = [o / L for k, o in engine.piggy_steps if k == n]
        cfg = engine.model.config
        item = engine.model.dtype.itemsize
        up = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * item
        down = cfg.num_attention_heads * cfg.head_dim * item
        return {
            "rows": n,
            "overhead_us_per_layer": 1e6 * statistics.median(per_layer),
            "wire_bytes_per_row": f"{up}+{down}",
        }
    finally:
        pool.close()
        worker.stop()
