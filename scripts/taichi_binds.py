"""What binds a TaiChi-style run (simulated: the roofline step model): one `simulate` at one rate.

    PYTHONPATH=. python scripts/taichi_binds.py --config configs/taichi.yaml --policy taichi \
        --slo sharegpt-slo1 --rate 23 --duration 300 > binds.json

Wraps the simulator's `compute_span` and the policy's `route` / `place_decode` / `tick` (nothing
in `tidal/` changes) and reports, over the requests that arrive inside the window:
* attainment and its split: TTFT only, TPOT only, both violated;
* per instance (its role): busy share of the window, steps, mean and p90 time of steps that
  carry decodes (the TBT those decodes see), mean decode batch, prefill and decode tokens/s;
* per request kind: prefilled on which role, decoded first on which role, flowed how often
  (degrading D->P, back-flow P->D), and the violations of each kind;
* Alg. 2: how many arrivals found a feasible instance and how many did not (the random draw);
* the requests and prompt + output tokens completed per second in the window's second half (at
  a rate above capacity: the wall no placement passes), preemptions, migrations and refusals;
* per instance also the largest decode batch (against the step's `max_batch_reqs` cap), the
  steps at that cap with decodes left out of the step, how many of those had HBM below the
  policy's memory watermark M (where Alg. 1 moves nothing), and the steps carrying more requests
  than the cap; per request the time it spent decoding-but-unscheduled, and the SLO misses of
  the requests that waited so.
Run from the repository root with PYTHONPATH=. so the checkout's code runs.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from typing import Any

import numpy as np

import tidal.policy.taichi.policy as taichi_mod
import tidal.sim.apply as apply_mod
import tidal.sim.build as build_mod
from tidal.config.cluster import load_config, override_streams
from tidal.policy.state import Phase
from tidal.sim.build import simulate
from tidal.sim.metrics import slo_flags, tpot_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/taichi.yaml")
    ap.add_argument("--policy", default="taichi")
    ap.add_argument("--slo", default=None, help="a slo_variants name")
    ap.add_argument("--rate", type=float, required=True, help="online Poisson rate, req/s")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    cfg = load_config(a.config, (f"online.rate={a.rate}", *a.set))
    if a.slo:
        cfg = cfg.with_slo(a.slo)
    cfg = override_streams(cfg, None, None, None, a.duration)

    steps: dict[int, list[tuple[float, float, int, int, int]]] = defaultdict(list)
    # per span, same index as `steps`: (HBM fraction, cap, requests in the step, left-out decodes)
    caps: dict[int, list[tuple[float, int, int, tuple[str, ...]]]] = defaultdict(list)
    orig_span = apply_mod.compute_span

    def span(inst, plan, reqs, now, copy_tokens, bg_copy_tokens=0, cuts=None):  # type: ignore[no-untyped-def]
        planned = set(plan.decode)
        left = tuple(
            r.req_id
            for r in inst.running
            if r.phase is Phase.RUNNING and r.is_decoding and r.req_id not in planned
        )
        frac = inst.num_used_blocks / inst.num_blocks
        n_req = len(planned | set(plan.prefill))
        s = orig_span(inst, plan, reqs, now, copy_tokens, bg_copy_tokens, cuts)
        p_tok = sum(n for _, n in s.prefill)
        step = (s.end_s - s.start_s) / s.k
        steps[inst.instance_id].append((s.start_s, step, s.k, len(s.decode), p_tok))
        caps[inst.instance_id].append((frac, inst.max_batch_reqs, n_req, left))
        return s

    apply_mod.compute_span = span  # type: ignore[assignment]

    prefill_on: dict[str, int] = {}
    decode_on: dict[str, int] = {}
    flows: dict[str, Counter[str]] = defaultdict(Counter)
    alg2 = Counter[str]()
    roles: list[str] = []
    orig_make = build_mod.make_policy
    orig_rp = taichi_mod.route_prefill

    def rp(*args, **kw):  # type: ignore[no-untyped-def]
        got = orig_rp(*args, **kw)
        alg2["infeasible" if got is None else "feasible"] += 1
        return got

    taichi_mod.route_prefill = rp  # type: ignore[assignment]

    def make(name, ctx):  # type: ignore[no-untyped-def]
        pol = orig_make(name, ctx)
        r0, p0, t0 = pol.route, pol.place_decode, pol.tick

        def route(req, cluster, now):  # type: ignore[no-untyped-def]
            got = r0(req, cluster, now)
            prefill_on[req.req_id] = got.instance_id
            return got

        def place(req, inst, cluster, now):  # type: ignore[no-untyped-def]
            got = p0(req, inst, cluster, now)
            decode_on[req.req_id] = inst.instance_id if got is None else got
            return got

        def tick(cluster, now):  # type: ignore[no-untyped-def]
            acts = t0(cluster, now)
            if not roles:
                roles.extend(i.role.value for i in cluster.instances)
            if acts.set_role:
                roles[:] = [acts.set_role.get(i, r) for i, r in enumerate(roles)]  # type: ignore[misc]
                roles[:] = [getattr(r, "value", r) for r in roles]
            where = {r.req_id: i.instance_id for i in cluster.instances for r in i.running}
            for m in acts.migrate:
                src = where.get(m.req_id)
                key = f"{roles[src] if src is not None else '?'}->{roles[m.dst]}"
                flows[m.req_id][key] += 1
            return acts

        pol.route, pol.place_decode, pol.tick = route, place, tick  # type: ignore[method-assign]
        return pol

    build_mod.make_policy = make  # type: ignore[assignment]
    rec = simulate(cfg, a.policy)
    t_end = a.duration
    on = [r for r in rec.requests if r.is_online and r.arrival_s < t_end]
    out: dict[str, Any] = {
        "label": "simulated (roofline step model)",
        "config": cfg.name,
        "policy": a.policy,
        "slo": a.slo,
        "rate": a.rate,
        "sets": a.set,
        "duration_s": t_end,
        "requests": len(on),
        "roles": roles,
        "alg2": dict(alg2),
        "preemptions": rec.num_preemptions,
        "migrations": rec.num_migrations,
        "migrations_refused": rec.num_migrations_refused,
    }
    viol = Counter[str]()
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    for r in on:
        ttft_ok, tpot_ok = slo_flags(r)
        v = "ok" if ttft_ok and tpot_ok else "ttft" if tpot_ok else "tpot" if ttft_ok else "both"
        viol[v] += 1
        pre = roles[prefill_on[r.req_id]] if r.req_id in prefill_on and roles else "?"
        dec = roles[decode_on[r.req_id]] if r.req_id in decode_on and roles else "?"
        f = flows.get(r.req_id, Counter())
        fl = "flowed" if f else "stayed"
        kinds[f"prefill {pre}"][v] += 1
        kinds[f"decode-init {dec}, {fl}"][v] += 1
    out["attainment_pct"] = round(100 * viol["ok"] / max(1, len(on)), 2)
    out["violations"] = dict(viol)
    out["by_kind"] = {k: dict(c) for k, c in sorted(kinds.items())}
    tot = Counter[str]()
    for c in flows.values():
        tot.update(c)
    out["flows"] = dict(tot)
    out["requests_flowed"] = sum(1 for r in on if r.req_id in flows)
    out["max_flows_per_request"] = max((sum(c.values()) for c in flows.values()), default=0)
    done = [r for r in on if r.phase is Phase.FINISHED]
    # Throughput in the window's second half: at an offered rate above capacity this is the
    # rate the four GPUs complete requests and tokens at (the wall no placement passes).
    h0 = t_end / 2
    late = [r for r in rec.requests if r.finish_s is not None and h0 <= r.finish_s < t_end]
    out["completed_req_per_s_2nd_half"] = round(len(late) / (t_end - h0), 2)
    out["completed_in_out_tok_per_s_2nd_half"] = round(
        sum(r.num_prompt_tokens + r.num_output_tokens for r in late) / (t_end - h0), 1
    )
    ttft = np.array([r.first_token_s - r.arrival_s for r in on if r.first_token_s is not None])
    tp = np.array([tpot_s(r) for r in done])
    out["ttft_p50_p90_p99_s"] = [round(float(np.percentile(ttft, q)), 3) for q in (50, 90, 99)]
    out["tpot_p50_p90_p99_ms"] = [round(1e3 * float(np.percentile(tp, q)), 1) for q in (50, 90, 99)]
    bins = int(t_end / rec.bin_s)
    watermark = float(cfg.policy_params(a.policy).get("memory_watermark", 0.95))
    waited: Counter[str] = Counter()  # req_id -> seconds decoding but left out of the step
    for iid, ss in sorted(steps.items()):
        w = [s for s in _applied(ss) if s[0] < t_end]
        at_cap = below_m = over_cap = 0
        for (_, st, k, nd, _), (frac, cap, n_req, left) in zip(w, caps[iid], strict=False):
            for rid in left:
                waited[rid] += st * k
            if nd >= cap and left:
                at_cap += k
                below_m += k if frac < watermark else 0
            over_cap += k if n_req > cap else 0
        busy = sum(rec.busy_s[iid][:bins])
        dec = [(st, k, nd) for _, st, k, nd, _ in w if nd]
        dk = np.array([st for st, k, _ in dec for _ in range(k)]) if dec else np.zeros(1)
        nd_w = sum(nd * k for _, k, nd in dec)
        out[f"instance_{iid}"] = {
            "role": roles[iid] if roles else "?",
            "busy_pct": round(100 * busy / t_end, 1),
            "steps": sum(k for _, _, k, _, _ in w),
            "decode_step_ms_mean_p90": [
                round(1e3 * float(dk.mean()), 1),
                round(1e3 * float(np.percentile(dk, 90)), 1),
            ],
            "mean_decode_batch": round(nd_w / max(1, sum(k for _, k, _ in dec)), 1),
            "max_decode_batch": max((nd for _, _, nd in dec), default=0),
            "prefill_tok_per_s": round(sum(p for _, _, _, _, p in w) / t_end, 1),
            "decode_tok_per_s": round(nd_w / t_end, 1),
            "steps_at_cap_with_decodes_left_out": at_cap,
            "of_which_hbm_below_watermark": below_m,
            "steps_over_request_cap": over_cap,
        }
    out["watermark"] = watermark
    wt = {r.req_id: waited[r.req_id] for r in on if waited[r.req_id] > 0}
    wv = Counter[str]()
    for r in on:
        if r.req_id in wt:
            t_ok, p_ok = slo_flags(r)
            wv["ok" if t_ok and p_ok else "ttft" if p_ok else "tpot" if t_ok else "both"] += 1
    vals = np.array(list(wt.values())) if wt else np.zeros(1)
    out["decodes_left_out"] = {
        "requests": len(wt),
        "wait_s_p50_p99_max": [round(float(np.percentile(vals, q)), 3) for q in (50, 99, 100)],
        "their_slo": dict(wv),
    }
    print(json.dumps(out, indent=1))


def _applied(
    ss: list[tuple[float, float, int, int, int]],
) -> list[tuple[float, float, int, int, int]]:
    """Spans as carried out: a repeated span cut short by the next one (an arrival ends a
    decode-only repeat early) keeps only the steps that started before the next span."""
    out = []
    for cur, nxt in zip(ss, [*ss[1:], None], strict=True):
        t0, step, k, nd, p = cur
        if nxt is not None and step > 0 and nxt[0] < t0 + k * step - 1e-9:
            k = max(1, min(k, round((nxt[0] - t0) / step)))
        out.append((t0, step, k, nd, p))
    return out


if __name__ == "__main__":
    main()
