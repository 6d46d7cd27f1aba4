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
The accounting (`accounting_gpu_s`): the gap between the offline limit and the run in GPU-seconds,
split into idle, busy above the floor, step overhead, online floor work above the limit's online
charge, offline floor work not counted as tokens, and the CPU credit left unused.
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
from tidal.sim.limit import config_limit, linear_floor
from tidal.sim.metrics import summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ooco.yaml")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--policy", default="tidal")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--violation", type=float, default=3.0, help="the limit's violation cap, %%")
    a = ap.parse_args()
    cfg = load_config(a.config, ("drain_s=30", *a.set))
    cfg = override_streams(cfg, None, None, None, a.duration)
    floor = linear_floor(
        _step_model(cfg.model, cfg.hardware, cfg.tp, cfg.latency_model, cfg.profile)
    )  # type: ignore[arg-type]
    nl = floor.num_layers
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
        # Per request class (online, offline): the floor's layer terms, split for the
        # accounting; a resumed chunk counts only the layers left (`cuts`: layers done).
        left = {
            r.req_id: 1.0 - (cuts[r.req_id][1] / nl if cuts and r.req_id in cuts else 0.0)
            for r, _ in s.prefill
        }
        parts = []
        for online in (True, False):
            pre = [(r, n) for r, n in s.prefill if r.is_online is online]
            dec = [r for r in s.decode if r.is_online is online]
            ncpu_c = sum(1 for r in s.cpu if r.is_online is online)
            parts.append(
                (
                    sum(n * left[r.req_id] for r, n in pre) + len(dec) + ncpu_c,
                    sum(n * (before[r.req_id] + n) * left[r.req_id] for r, n in pre),
                    sum(n * left[r.req_id] for r, n in pre),
                    sum(1 for r, n in pre if before[r.req_id] + n >= r.num_prompt_tokens),
                    len(dec),
                    sum(r.num_computed_tokens for r in dec),
                    ncpu_c,
                    sum(n * (n - 1) / 2 * left[r.req_id] for r, n in pre),
                )
            )
        spans.append(
            (inst.instance_id, s, p_tok, on_pre, pairs, len(s.decode), ctx, len(s.cpu), parts)
        )
        return s

    apply_mod.compute_span = wrapped  # type: ignore[assignment]
    rec = simulate(cfg, a.policy)
    t_end = a.duration
    summ = summarize(rec, t_end, a.policy, cfg.name)
    st: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    f = floor
    for iid, s, p_tok, on_pre, pairs, nd, ctx, ncpu, parts in spans:
        if s.start_s >= t_end:
            continue
        d = st[iid]
        dur = min(s.end_s, t_end) - s.start_s
        d["steps"] += s.k
        d["busy_s"] += dur
        d["prefill_tok"] += p_tok
        d["online_prefill_tok"] += on_pre
        d["decode_tok"] += nd * s.k
        n_tok, n_seq = p_tok + nd + ncpu, len(s.prefill) + nd + ncpu
        fl, flops_side = max(
            (f.step_floor_s(n_tok, n_seq, p_tok, pairs, nd, ctx, side), side)
            for side in (True, False)
        )
        d["floor_s"] += fl + (s.k - 1) * (f.step_floor_s(nd, nd, 0, 0, nd, ctx, True))
        # The accounting: each class's share of the floor, a cut step's layer terms at the
        # share of layers it ran (the resuming step counts the rest), its LM head not at all.
        phi = s.cut_layer / nl if s.cut_layer else 1.0
        for name, (n_c, pairs_c, ptok_c, done_c, dec_c, ctx_c, cpu_c, xs_c) in zip(
            ("online", "offline"), parts, strict=True
        ):
            pre = f.prefill_pair_s * pairs_c if flops_side else f.prefill_token_attn_s * ptok_c
            dec_l = f.decode_ctx_s * ctx_c + f.decode_req_s * dec_c
            layer = f.per_token_s * n_c + pre + dec_l
            seqs = 0 if s.cut_layer else done_c + dec_c + cpu_c
            more = (s.k - 1) * (nl * (f.per_token_s * dec_c + dec_l) + f.per_seq_s * dec_c)
            d[f"{name}_floor_s"] += nl * layer * phi + f.per_seq_s * seqs + more
            if flops_side and name == "offline":  # chunks' pairs above the causal I(I+1)/2
                d["offline_pairs_above_causal_s"] += nl * f.prefill_pair_s * xs_c * phi
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
    out["accounting_gpu_s"] = accounting(cfg, a, st, summ["offline"]["tokens_per_s"] * t_end)
    for iid, d in sorted(st.items()):
        n = d.get("offline_prefill_steps", 0.0)
        d["mean_offline_prefill_tok"] = d.get("offline_prefill_tok", 0.0) / n if n else 0.0
        d["floor_share"] = d["floor_s"] / d["busy_s"] if d["busy_s"] else 0.0
        out[f"instance_{iid}"] = {k: round(v, 3) for k, v in d.items()}
        out[f"instance_{iid}_snapshots_30s"] = [v for _, v in sorted(snaps[iid].items())]
    print(json.dumps(out, indent=1))


def accounting(
    cfg: Any, a: argparse.Namespace, st: dict[int, dict[str, float]], tokens: float
) -> dict[str, float]:
    """The gap between the offline limit and the run, in GPU-seconds of the window (simulated):
    N T + credit = online charge + limit x T x kappa (the bound), and N T = idle + (busy - floor)
    + step overhead + online floor + offline floor of the run, so (limit - run) x T x kappa is
    the sum of the items below (`offline_floor_not_counted`: the run's offline floor work beyond
    kappa x the tokens counted in the window: chunks' attention above causal, work for tokens
    after the window, a served mix dearer than the offered one)."""
    lim = config_limit(cfg, a.policy, a.violation)
    kappa, t = lim.offline_s_per_token, a.duration
    tot = {k: sum(d.get(k, 0.0) for d in st.values()) for k in ("busy_s", "floor_s")}
    parts = {
        k: sum(d.get(k, 0.0) for d in st.values())
        for k in ("overhead_s", "online_floor_s", "offline_floor_s", "offline_pairs_above_causal_s")
    }
    run_floor = parts["overhead_s"] + parts["online_floor_s"] + parts["offline_floor_s"]
    items = {
        "limit_tokens_per_s": lim.limit_tokens_per_s,
        "kappa_ms_per_token": kappa * 1e3,
        "gap_gpu_s": (lim.limit_tokens_per_s * t - tokens) * kappa,
        "idle": lim.gpu_s - tot["busy_s"],
        "busy_above_floor": tot["busy_s"] - run_floor,
        "step_overhead": parts["overhead_s"],
        "online_floor_above_charge": parts["online_floor_s"] - lim.online_gpu_s,
        "offline_floor_not_counted": parts["offline_floor_s"] - tokens * kappa,
        "of_it_offline_pairs_above_causal": parts["offline_pairs_above_causal_s"],
        "cpu_credit_unused": lim.cpu_credit_s,
    }
    return {k: round(v, 2) for k, v in items.items()}


if __name__ == "__main__":
    main()
