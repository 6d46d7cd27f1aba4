"""Where HyGen's P99 TTFT goes, against pure online Sarathi (simulated: the roofline step model).

    PYTHONPATH=. python scripts/hygen_ttft_tail.py --config configs/hygen-paper.yaml \
        --duration 600 --run 0.045325:true --run 0.1:true --run 0.03:false > tail.json

Each `--run BUDGET:BUDGETED` is one `hygen` run at that latency budget (seconds) with
`online_prefill_budgeted` true or false; the reference is the same online stream alone under
`aggregated` (pure online Sarathi, HyGen §5.1). Wraps the simulator's `finish_span` (nothing in
`tidal/` changes) to log every step: its time, its online and offline prefill tokens, its
online and offline decodes. Per run: P99 TTFT, mean and P99 TBT, offline tokens/s; over the
steps that carry an online prefill chunk, their mean time, online and offline prefill tokens,
online and offline decodes and the share carrying offline work; the mean time of online
decode-only steps; and for the slowest 1 % of online requests by TTFT (the P99 tail), the same
requests under pure online beside them: TTFT, wait before their first chunk, chunks, time in
their chunk steps, time between chunks, mean chunk size, offline tokens in their chunk steps,
online decodes per chunk step.
Run from the repository root with PYTHONPATH=. so the checkout's code runs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import numpy as np

import tidal.sim.core as core
from tidal.config.cluster import ClusterConfig, load_config, override_streams
from tidal.sim.best_of import with_setting
from tidal.sim.build import simulate
from tidal.sim.metrics import summarize

# (start, end, steps in the span, prefill (req_id, online, tokens), online and offline decodes)
Step = tuple[float, float, int, list[tuple[str, bool, int]], int, int]
LOG: list[Step] = []
_finish = core.finish_span


def _logged(inst, span, now, rec, cuts=None):  # type: ignore[no-untyped-def]
    on_dec = sum(1 for r in span.decode if r.is_online)
    pre = [(r.req_id, r.is_online, m) for r, m in span.prefill]
    k = span.k
    LOG.append((span.start_s, span.bounds[k - 1], k, pre, on_dec, len(span.decode) - on_dec))
    return _finish(inst, span, now, rec, cuts)


core.finish_span = _logged


def _run(cfg: ClusterConfig, policy: str) -> tuple[Any, list[Step]]:
    LOG.clear()
    rec = simulate(cfg, policy)
    return rec, list(LOG)


def _chunks(log: list[Step]) -> dict[str, list[dict[str, float]]]:
    """Online req_id -> its prefill chunks, each with the step it ran in."""
    out: dict[str, list[dict[str, float]]] = {}
    for s, e, _, pre, on_dec, off_dec in log:
        off_pre = sum(m for _, o, m in pre if not o)
        for rid, online, m in pre:
            if online:
                c = {"ms": (e - s) * 1e3, "tokens": m, "offline": off_pre + off_dec}
                out.setdefault(rid, []).append({**c, "online_decodes": on_dec})
    return out


def _steps(log: list[Step]) -> dict[str, Any]:
    on = [
        (e - s, sum(m for _, o, m in pre if o), sum(m for _, o, m in pre if not o), nd, fd)
        for s, e, _, pre, nd, fd in log
        if any(o for _, o, _ in pre)
    ]
    a = np.array(on, dtype=float)
    dec = [(e - s) / k for s, e, k, pre, nd, _ in log if not pre and nd]
    return {
        "steps_with_online_prefill": len(a),
        "their_mean_ms": float(a[:, 0].mean() * 1e3),
        "their_mean_online_prefill_tokens": float(a[:, 1].mean()),
        "their_mean_offline_prefill_tokens": float(a[:, 2].mean()),
        "their_mean_online_decodes": float(a[:, 3].mean()),
        "their_mean_offline_decodes": float(a[:, 4].mean()),
        "share_carrying_offline_work": float(np.mean((a[:, 2] + a[:, 4]) > 0)),
        "online_decode_only_step_mean_ms": float(np.mean(dec) * 1e3) if dec else None,
    }


def _tail(rec: Any, chunks: dict[str, list[dict[str, float]]], ids: list[str]) -> dict[str, Any]:
    reqs = {r.req_id: r for r in rec.requests}

    def mean(f: Any) -> float:
        return float(np.mean([f(reqs[i], chunks[i]) for i in ids]))

    return {
        "ttft_ms": mean(lambda r, c: (r.first_token_s - r.arrival_s) * 1e3),
        "wait_before_first_chunk_ms": mean(lambda r, c: (c[0]["start"] - r.arrival_s) * 1e3),
        "chunks": mean(lambda r, c: len(c)),
        "chunk_steps_ms": mean(lambda r, c: sum(x["ms"] for x in c)),
        "between_chunks_ms": mean(
            lambda r, c: (r.first_token_s - c[0]["start"]) * 1e3 - sum(x["ms"] for x in c)
        ),
        "mean_chunk_tokens": mean(lambda r, c: np.mean([x["tokens"] for x in c])),
        "offline_tokens_in_chunk_steps": mean(lambda r, c: sum(x["offline"] for x in c)),
        "online_decodes_per_chunk_step": mean(
            lambda r, c: np.mean([x["online_decodes"] for x in c])
        ),
        "prompt_tokens": mean(lambda r, c: r.num_prompt_tokens),
    }


def _with_starts(log: list[Step]) -> dict[str, list[dict[str, float]]]:
    out = _chunks(log)
    starts: dict[str, list[float]] = {}
    for s, _, _, pre, _, _ in log:
        for rid, online, _ in pre:
            if online:
                starts.setdefault(rid, []).append(s)
    for rid, cs in out.items():
        for c, s in zip(cs, starts[rid], strict=True):
            c["start"] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/hygen-paper.yaml")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--run", action="append", required=True, metavar="BUDGET:BUDGETED")
    ap.add_argument("--tail", type=float, default=0.01, help="share of online requests")
    a = ap.parse_args()
    cfg = override_streams(load_config(a.config, tuple(a.set)), None, None, None, a.duration)
    rec0, log0 = _run(replace(cfg, offline=None), "aggregated")
    s0 = summarize(rec0, cfg.duration_s, "aggregated", cfg.name)
    ref_p99 = s0["online"]["ttft_s"]["p99"]
    c0 = _with_starts(log0)
    out: dict[str, Any] = {
        "label": "simulated",
        "config": cfg.name,
        "duration_s": cfg.duration_s,
        "seed": cfg.seed,
        "sets": a.set,
        "pure_online": {
            "ttft_p99_ms": ref_p99 * 1e3,
            "tbt_mean_ms": s0["online"]["tbt_s"]["mean"] * 1e3,
            "tbt_p99_ms": s0["online"]["tbt_s"]["p99"] * 1e3,
            "steps": _steps(log0),
        },
        "hygen": [],
    }
    for spec in a.run:
        budget, _, flag = spec.partition(":")
        setting = (("latency_budget_s", float(budget)), ("online_prefill_budgeted", flag == "true"))
        rec, log = _run(with_setting(cfg, "hygen", setting), "hygen")
        s = summarize(rec, cfg.duration_s, "hygen", cfg.name)
        c1 = _with_starts(log)
        on = [r for r in rec.requests if r.is_online and r.first_token_s is not None]
        on.sort(key=lambda r: r.arrival_s - r.first_token_s)  # slowest first
        ids = [r.req_id for r in on[: max(1, round(len(on) * a.tail))]]
        p99 = s["online"]["ttft_s"]["p99"]
        out["hygen"].append(
            {
                "latency_budget_s": float(budget),
                "online_prefill_budgeted": flag == "true",
                "ttft_p99_ms": p99 * 1e3,
                "ttft_p99_vs_pure_online": p99 / ref_p99 - 1,
                "tbt_mean_ms": s["online"]["tbt_s"]["mean"] * 1e3,
                "tbt_p99_ms": s["online"]["tbt_s"]["p99"] * 1e3,
                "offline_tokens_per_s": s["offline"]["tokens_per_s"],
                "steps": _steps(log),
                "tail_requests": len(ids),
                "tail_in_hygen": _tail(rec, c1, ids),
                "tail_in_pure_online": _tail(rec0, c0, ids),
            }
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
