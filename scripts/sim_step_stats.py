"""Per-instance step statistics of one simulated run (simulated: the roofline step model).

    python scripts/sim_step_stats.py --config configs/ooco.yaml --duration 600 \
        --set offline.rate=16 [--set policies.tidal.relaxed_fill=false] > stats.json

Wraps the simulator's `compute_span` (nothing in `tidal/` changes) and, per instance, over the
steps that start inside the window: steps, busy time, prefill tokens (online and offline),
offline-only prefill steps and their mean size, decode tokens, the per-step overhead (the
offline limit's floor `per_step_s` each step), steps cut at a layer boundary (OOCO §3.4.1) with
their time and prefill tokens (the chunks resume later from the cut layer), and `floor_share`
(the steps' floor time from `tidal.sim.limit.linear_floor` over busy time; a cut step and the
step resuming it are each priced whole, so it can pass 1).
Also the offline requests in flight at the window's end and 30 s snapshots of each instance:
(offline running, of them decoding, their KV tokens, free KV tokens, waiting requests).
Run from the repository root with PYTHONPATH=. so the checkout's code runs.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import tidal.sim.apply as apply_mod
from tidal.config.cluster import load_config, override_streams
from tidal.sim.build import _step_model, simulate
from tidal.sim.limit import linear_floor
from tidal.sim.metrics import summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ooco.yaml")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--policy", default="tidal")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    cfg = load_config(a.config, ("drain_s=30", *a.set))
    cfg = override_streams(cfg, None, None, None, a.duration)
    floor = linear_floor(
        _step_model(cfg.model, cfg.hardware, cfg.tp, cfg.latency_model, cfg.profile)
    )  # type: ignore[arg-type]
    spans: list[tuple[Any, ...]] = []
    snaps: dict[int, dict[int, tuple[int, ...]]] = defaultdict(dict)
    orig = apply_mod.compute_span

    def wrapped(inst, plan, reqs, now, copy_tokens, bg_copy_tokens=0, cuts=None):  # type: ignore[no-untyped-def]
        before = {rid: reqs[rid].num_computed_tokens if rid in reqs else 0 for rid in plan.prefill}
        s = orig(inst, plan, reqs, now, copy_tokens, bg_copy_tokens, cuts)
        b = int(now // 30)
        if b not in snaps[inst.instance_id]:
            off = [r for r in inst.running if not r.is_online]
            snaps[inst.instance_id][b] = (
                len(off),
                sum(1 for r in off if r.is_decoding),
                sum(r.num_computed_tokens for r in off),
                inst.num_free_blocks * inst.block_size,
                len(inst.waiting),
            )
        p_tok = sum(n for _, n in s.prefill)
        pairs = sum(n * (before[r.req_id] + n) for r, n in s.prefill)
        on_pre = sum(n for r, n in s.prefill if r.is_online)
        ctx = sum(r.num_computed_tokens for r in s.decode)
        spans.append((inst.instance_id, s, p_tok, on_pre, pairs, len(s.decode), ctx, len(s.cpu)))
        return s

    apply_mod.compute_span = wrapped  # type: ignore[assignment]
    rec = simulate(cfg, a.policy)
    t_end = a.duration
    summ = summarize(rec, t_end, a.policy, cfg.name)
    st: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for iid, s, p_tok, on_pre, pairs, nd, ctx, ncpu in spans:
        if s.start_s >= t_end:
            continue
        d = st[iid]
        dur = s.end_s - s.start_s
        d["steps"] += s.k
        d["busy_s"] += dur
        d["prefill_tok"] += p_tok
        d["online_prefill_tok"] += on_pre
        d["decode_tok"] += nd * s.k
        n_tok, n_seq = p_tok + nd + ncpu, len(s.prefill) + nd + ncpu
        fl = max(
            floor.step_floor_s(n_tok, n_seq, p_tok, pairs, nd, ctx, side) for side in (True, False)
        )
        d["floor_s"] += fl + (s.k - 1) * (floor.step_floor_s(nd, nd, 0, 0, nd, ctx, True))
        d["overhead_s"] += s.k * floor.per_step_s
        if s.cut_layer:
            d["cut_steps"] += 1
            d["cut_s"] += dur
            d["cut_prefill_tok"] += p_tok
        if p_tok and not on_pre:
            d["offline_prefill_steps"] += 1
            d["offline_prefill_tok"] += p_tok
    off = [r for r in rec.requests if not r.is_online]
    inflight = [
        r
        for r in off
        if r.first_token_s is not None
        and r.first_token_s <= t_end
        and (r.finish_s is None or r.finish_s > t_end)
    ]
    out: dict[str, Any] = {
        "label": "simulated",
        "config": cfg.name,
        "policy": a.policy,
        "sets": a.set,
        "duration_s": t_end,
        "offline_tokens_per_s": summ["offline"]["tokens_per_s"],
        "online_violation_pct": summ["online"]["violation_pct"],
        "layer_preemptions": rec.num_layer_preemptions,
        "offline_in_flight_at_end": len(inflight),
        "offline_in_flight_prompt_tokens": sum(r.num_prompt_tokens for r in inflight),
    }
    for iid, d in sorted(st.items()):
        n = d.get("offline_prefill_steps", 0.0)
        d["mean_offline_prefill_tok"] = d.get("offline_prefill_tok", 0.0) / n if n else 0.0
        d["floor_share"] = d["floor_s"] / d["busy_s"] if d["busy_s"] else 0.0
        out[f"instance_{iid}"] = {k: round(v, 3) for k, v in d.items()}
        out[f"instance_{iid}_snapshots_30s"] = [v for _, v in sorted(snaps[iid].items())]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
