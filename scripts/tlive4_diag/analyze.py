"""Summarise the step and token logs `sitecustomize.py` (this folder) wrote during one live
`tidal bench colocation` run: per instance and kind of step, measured against predicted step
time, the strict budget and what the steps carried; per online request, its TPOT, the hand-off
from its first token (relaxed instance) to its next (strict instance) and whether it missed the
SLO. Prints a table and writes it as JSON.

    python scripts/tlive4_diag/analyze.py LOG_DIR OUT.json [--tpot-slo-s 0.25]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log_dir")
    ap.add_argument("out")
    ap.add_argument("--tpot-slo-s", type=float, default=0.25)
    a = ap.parse_args()
    ev = [json.loads(x) for f in glob.glob(os.path.join(a.log_dir, "*.jsonl")) for x in open(f)]
    toks = [e for e in ev if e["ev"] == "tok"]
    steps = [e for e in ev if e["ev"] == "step"]
    t0 = min(e["t"] for e in toks)
    t_off = min(e["end_s"] for e in steps if e.get("pre_off", 0) > 0)  # the offline load began
    out: dict = {"offline_from_s": round(t_off - t0, 2), "steps": {}, "online": []}
    kinds = {
        "offline prefill": lambda e: e.get("pre_off", 0) > 0,
        "decode only": lambda e: not e.get("pre_off") and not e.get("pre_on"),
        "online prefill": lambda e: e.get("pre_on", 0) > 0,
    }
    print(f"offline load from t={t_off - t0:.1f} s; steps from then on:")
    for iid in sorted({e["id"] for e in steps}):
        v = [e for e in steps if e["id"] == iid and e["end_s"] >= t_off and e.get("pred_s")]
        role = v[0]["role"] if v else "?"
        span = max(e["end_s"] for e in v) - t_off if v else 0.0
        busy = sum(e["step_s"] for e in v)
        print(f"== {iid} ({role}): {len(v)} steps, stepping {busy:.1f} s of {span:.1f} s")
        per: dict = {"role": role, "num_steps": len(v), "busy_s": busy, "span_s": span}
        for kind, sel in kinds.items():
            xs = [e for e in v if sel(e)]
            if not xs:
                continue
            meas = [e["step_s"] for e in xs]
            pred = [e["pred_s"] for e in xs]
            ratio = [e["step_s"] / e["pred_s"] for e in xs]
            bud = [e["budget_s"] for e in xs if e.get("budget_s") is not None]
            row = {
                "n": len(xs),
                "measured_ms_p50_p90_max": [q(meas, 0.5) * 1e3, q(meas, 0.9) * 1e3, max(meas) * 1e3],
                "predicted_ms_p50_max": [q(pred, 0.5) * 1e3, max(pred) * 1e3],
                "measured_over_predicted_p10_p50_p90": [q(ratio, 0.1), q(ratio, 0.5), q(ratio, 0.9)],
                "sum_measured_over_sum_predicted": sum(meas) / sum(pred),
                "budget_ms_p50_min_max": [q(bud, 0.5) * 1e3, min(bud) * 1e3, max(bud) * 1e3]
                if bud
                else None,
                "online_decodes_p50_max": [q([e["dec_on"] for e in xs], 0.5), max(e["dec_on"] for e in xs)],
                "offline_decodes_p50_max": [q([e["dec_off"] for e in xs], 0.5), max(e["dec_off"] for e in xs)],
                "offline_prefill_tokens_p50_max": [q([e["pre_off"] for e in xs], 0.5), max(e["pre_off"] for e in xs)],
            }
            per[kind] = row
            r = row["measured_over_predicted_p10_p50_p90"]
            m = row["measured_ms_p50_p90_max"]
            print(
                f"  {kind:16s} n={len(xs):4d} measured p50/p90/max {m[0]:4.0f}/{m[1]:4.0f}/{m[2]:4.0f} ms"
                f" predicted p50 {row['predicted_ms_p50_max'][0]:4.0f} ms; measured/predicted"
                f" p10/p50/p90 {r[0]:.2f}/{r[1]:.2f}/{r[2]:.2f}; budget {row['budget_ms_p50_min_max']}"
            )
        out["steps"][iid] = per
    by: dict = defaultdict(list)
    for e in toks:
        by[e["req"]].append((e["t"], e["id"], e["n"]))
    print("online requests (t from the first online token):")
    for rid, v in sorted(by.items(), key=lambda kv: min(x[0] for x in kv[1])):
        v.sort()
        n = sum(x[2] for x in v)
        if n < 2:
            continue
        tpot = (v[-1][0] - v[0][0]) / (n - 1)
        nxt = [x for x in v if x[1] != v[0][1]]
        hand = nxt[0][0] - v[0][0] if nxt else None
        row = {
            "t_s": round(v[0][0] - t0, 2),
            "req": rid[:8],
            "tokens": n,
            "tpot_ms": round(tpot * 1e3, 1),
            "handoff_ms": None if hand is None else round(hand * 1e3),
            "missed": tpot > a.tpot_slo_s,
            "during_offline": v[0][0] >= t_off,
        }
        out["online"].append(row)
        print(f"  t={row['t_s']:6.1f} {row['req']} tpot {row['tpot_ms']:5.0f} ms hand-off {row['handoff_ms']} ms {'MISS' if row['missed'] else ''}")
    dur = [r for r in out["online"] if r["during_offline"]]
    out["online_during_offline"] = {
        "n": len(dur),
        "missed": sum(r["missed"] for r in dur),
        "tpot_ms_p50_max": [q([r["tpot_ms"] for r in dur], 0.5), max((r["tpot_ms"] for r in dur), default=0)],
        "handoff_ms_p50_max": [q([r["handoff_ms"] or 0 for r in dur], 0.5), max((r["handoff_ms"] or 0 for r in dur), default=0)],
    }
    print("during the offline load:", out["online_during_offline"])
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
