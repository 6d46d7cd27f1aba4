"""Where one decode step's time goes: `tidal bench engine --profile`.

Runs `steps` decode steps of `batch` requests under `torch.profiler` (with the Python tracer) and
charges every top-level aten op to a phase by its op, the Tidal function that called it and, for
matmuls, the weight's shape. Python time is each Tidal frame's own time outside ops. The
profiler inflates small ops and Python frames, so the step's wall time is measured without it
and the phases are reported beside it, not scaled to it.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch.engine import TorchEngine
from tidal_bench.engine.measure import _prompts

# (calling function, aten op) -> phase; matmuls are split by weight shape in `_phase`
_BY_FUNC = {
    "plan": "schedule",
    "schedulable": "schedule",
    "_prepare": "schedule",
    "_build": "input prep",
    "_meta": "input prep",
    "_slots": "input prep",
    "logits": "final norm + lm_head",
    "sample": "sampling",
    "update": "detokenise",
}
# the matmuls of the layers and LM head; `mkldnn::_linear_pointwise` runs on packed weights
_MATMUL_OPS = ("aten::mm", "aten::linear", "aten::addmm", "mkldnn::_linear_pointwise")
_ATTN_FUNCS = ("sdpa_paged_attention", "decode_attention", "_decode_attention")
_OTHER: collections.Counter[str] = collections.Counter()  # op -> us, for a look at "other ops"
PHASES = (
    "schedule",
    "input prep",
    "rms_norm",
    "matmul qkv",
    "rope",
    "kv scatter",
    "kv gather",
    "attention math",
    "matmul o_proj",
    "matmul gate_up",
    "silu*mul",
    "matmul down",
    "residual add",
    "final norm + lm_head",
    "sampling",
    "detokenise",
    "other ops",
)


def _func(ev: Any) -> str:
    s = ev.name
    return s.split("): ")[-1] if "): " in s else s


def _py_parent(ev: Any) -> Any:
    p = ev.cpu_parent
    while p is not None and p.name.startswith(("aten::", "mkldnn::", "<built-in")):
        p = p.cpu_parent
    return p


def _owner(ev: Any) -> Any:
    """The outermost Tidal frame among ev and its ancestors whose phase is counted whole."""
    found, e = None, ev
    while e is not None:
        if "tidal/" in e.name and _func(e) in _BY_FUNC:
            found = e
        e = e.cpu_parent
    return found


def _phase(ev: Any, func: str, cfg: Any) -> str:
    op = ev.name
    if op in _MATMUL_OPS and func not in _ATTN_FUNCS:
        dims = {d for s in ev.input_shapes or [] if s and len(s) == 2 for d in s}
        if cfg.vocab_size in dims:
            return "final norm + lm_head"
        if cfg.q_size + 2 * cfg.kv_size in dims:
            return "matmul qkv"
        if 2 * cfg.intermediate_size in dims:
            return "matmul gate_up"
        if cfg.intermediate_size in dims:
            return "matmul down"
        return "matmul o_proj"
    if func in _BY_FUNC:
        return _BY_FUNC[func]
    if op == "aten::rms_norm":
        return "rms_norm"
    if op == "aten::index_copy_":
        return "kv scatter"
    if func in _ATTN_FUNCS:
        return "kv gather" if op == "aten::index_select" else "attention math"
    if op in ("aten::silu",):
        return "silu*mul"
    if op == "aten::add_":
        return "residual add"
    if op in ("aten::roll", "aten::addcmul", "aten::mul", "aten::cat", "aten::neg", "aten::add"):
        return "rope"
    if op == "aten::index_select":
        return "rope"  # cos/sin lookup and rotation in forward_layers
    _OTHER[op] += ev.cpu_time_total
    return "other ops"


def profile_decode(engine: TorchEngine, batch: int, prompt_len: int = 64, steps: int = 10) -> dict:
    """{"wall_ms": median step without the profiler, "phases": {phase: ms/step},
    "python_ms": Tidal frames' own time/step, "ops_ms": sum of ops/step}."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=steps * 4 + 40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt_len, engine.model.config.vocab_size)):
        engine.add(EngineRequest(f"prof-{i}", p, sp))
    while any(not s.is_decode for s in engine.seqs.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps * 2):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True) as prof:
        for _ in range(steps):
            engine.step()
    for rid in list(engine.seqs):
        engine.abort(rid)
    cfg = engine.model.config
    phases: collections.Counter[str] = collections.Counter()
    py = 0.0
    for ev in prof.events():
        owner = _owner(ev)
        if owner is not None:  # inside a phase counted whole (its Python frame, ops included)
            if owner is ev:
                phases[_BY_FUNC[_func(ev)]] += ev.cpu_time_total
            continue
        if ev.name.startswith(("aten::", "mkldnn::")):
            if ev.cpu_parent is not None and ev.cpu_parent.name.startswith(("aten::", "mkldnn::")):
                continue
            pp = _py_parent(ev)
            phases[_phase(ev, _func(pp) if pp is not None else "?", cfg)] += ev.cpu_time_total
        elif "tidal/" in ev.name:
            py += ev.cpu_time_total - sum(c.cpu_time_total for c in ev.cpu_children)
    scale = 1e-3 / steps
    return {
        "wall_ms": 1e3 * statistics.median(times),
        "phases": {k: phases.get(k, 0.0) * scale for k in PHASES},
        "python_ms": py * scale,
        "ops_ms": sum(phases.values()) * scale,
    }


def format_table(results: dict[str, dict]) -> str:
    """Markdown table: one column per run (e.g. "bf16 b1")."""
    cols = list(results)
    lines = ["| phase (ms/step) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]

    def row(name: str, values: list[float]) -> None:
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")

    for ph in PHASES:
        row(ph, [results[c]["phases"][ph] for c in cols])
    row("all ops (profiled)", [results[c]["ops_ms"] for c in cols])
    row("Python in Tidal frames (profiled)", [results[c]["python_ms"] for c in cols])
    row("**step wall time, no profiler**", [results[c]["wall_ms"] for c in cols])
    return "\n".join(lines)
