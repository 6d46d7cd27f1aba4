"""The offline limit before and after the SLO-pace step floor (`tidal.sim.limit`, point 7), for
the configs and windows whose policies' figures docs/policies.md and docs/colocation.md record,
and each recorded figure's share of both. Every figure is simulated: derived from the roofline
step model, no policy run.

    # from the repository root; writes limit_pacing.json and limit_pacing.md there
    PYTHONPATH=. python docs/results/limit/pacing/limit_pacing.py --out docs/results/limit/pacing

"old" is point 2's bound alone (the limit as computed before point 7), "new" the smaller of the
two. The policy figures (offline tok/s) are copied from the docs, each from a run whose limit
was computed with the same config, window, offline mix rate and violation cap as its row here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from tidal.config.cluster import load_config
from tidal.sim.limit import OfflineLimit, config_limit
from tidal_bench.colocation.caps import window_limit

ARXIV = "offline.source=arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
TORCH_SETS = (
    "online.max_input_tokens=256",
    "online.max_output_tokens=32",
    "offline.max_input_tokens=256",
    "offline.max_output_tokens=32",
    "profile=docs/results/colocation/torch_steps_profile_batch128.json",
)

# name, config, --set overrides, window s, offline mix QPS, violation %, policy whose instances
# the limit counts, recorded offline tok/s per policy (the docs' figure, with what it was)
SIM = [
    (
        "ooco.yaml, first 600 s",
        "configs/ooco.yaml",
        (),
        600.0,
        16.0,
        3.0,
        "tidal",
        {
            "online-priority (cap 128)": 3104,
            "ooco (0.4 s cap)": 3142,
            "tidal": 4338,
        },
    ),
    (
        "ooco.yaml, the hour at 16 offered QPS",
        "configs/ooco.yaml",
        (),
        3600.0,
        16.0,
        3.0,
        "tidal",
        {
            "online-priority (cap 128)": 2858,
            "ooco (0.4 s cap)": 2896,
            "tidal": 4219,
        },
    ),
    (
        "ooco-code.yaml, first 1,200 s",
        "configs/ooco-code.yaml",
        (),
        1200.0,
        16.0,
        3.0,
        "ooco",
        {"online-priority (cap 128)": 5149, "ooco (0.4 s cap)": 5418},
    ),
    (
        "ooco-code.yaml, first 600 s (32 QPS mix)",
        "configs/ooco-code.yaml",
        (),
        600.0,
        32.0,
        3.0,
        "tidal",
        {"tidal": 6219},
    ),
    (
        "ooco-72b.yaml, first 600 s",
        "configs/ooco-72b.yaml",
        (),
        600.0,
        4.0,
        3.0,
        "ooco",
        {"online-priority (cap 64)": 1161, "ooco (0.4 s cap)": 1174},
    ),
    (
        "ooco.yaml + arXiv offline, first 600 s",
        "configs/ooco.yaml",
        (ARXIV,),
        600.0,
        16.0,
        3.0,
        "tidal",
        {
            "online-priority (every cap)": 1422,
            "ooco (0.05 s cap)": 1329,
            "tidal": 2341,
        },
    ),
    (
        "ooco.yaml + arXiv offline, first 600 s (8 QPS mix)",
        "configs/ooco.yaml",
        (ARXIV,),
        600.0,
        8.0,
        3.0,
        "ooco",
        {"ooco (0.4 s cap)": 1397},
    ),
    ("hygen.yaml, 1,800 s", "configs/hygen.yaml", (), 1800.0, None, 3.0, None, {}),
    ("omniserve.yaml, 1,800 s", "configs/omniserve.yaml", (), 1800.0, None, 3.0, None, {}),
]

# name, config, --set overrides, warm-up + measured s, devices, recorded live offline tok/s
LIVE = [
    (
        "live, sim engine: ooco.yaml trace s 0-14 (emulated)",
        "configs/ooco.yaml",
        ("offline.max_output_tokens=256", "handout_ms=10.6"),
        14.0,
        None,
        {"online-priority": 2414, "ooco (0.4 s cap)": 2641, "tidal": 3036},
    ),
    (
        "live, torch engine: embedded.yaml s 0-25, 2 instances on 1 core",
        "configs/embedded.yaml",
        TORCH_SETS,
        25.0,
        1,
        {"tidal": 87.4, "online-priority": 82.0, "ooco (0.4 s cap)": 79.5},
    ),
]


def row(name: str, lim: OfflineLimit, figures: dict[str, float], wall_s: float) -> dict[str, Any]:
    old, new = lim.kv_bound_tokens_per_s, lim.limit_tokens_per_s
    return {
        "case": name,
        "old_limit_tokens_per_s": round(old, 1),
        "new_limit_tokens_per_s": round(new, 1),
        "pacing_bound_tokens_per_s": None
        if lim.pacing_bound_tokens_per_s is None
        else round(lim.pacing_bound_tokens_per_s, 1),
        "binding": lim.binding,
        "paced_steps": lim.paced_steps,
        "paced_gpu_s": round(lim.paced_gpu_s, 2),
        "gpu_s": lim.gpu_s,
        "num_online_charged": lim.num_online_charged,
        "shares": {
            p: {"tokens_per_s": t, "old": round(t / old, 4), "new": round(t / new, 4)}
            for p, t in figures.items()
        },
        "wall_s": round(wall_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/limit/pacing")
    args = ap.parse_args()
    rows = []
    for name, path, sets, dur, rate, viol, pol, figures in SIM:
        t0 = time.perf_counter()
        cfg = load_config(path, (*sets, f"duration_s={dur}"))
        lim = config_limit(cfg, pol or cfg.policy, viol, rate)
        rows.append(row(name, lim, figures, time.perf_counter() - t0))
        rows[-1] |= {"offline_mix_qps": rate or cfg.offline.rate, "violation_pct": viol}
        print(json.dumps(rows[-1]), flush=True)
    for name, path, sets, dur, devices, figures in LIVE:
        t0 = time.perf_counter()
        cfg = dataclasses.replace(load_config(path, sets), duration_s=dur)
        lim = window_limit(cfg, "tidal", 3.0, 0, devices)
        rows.append(row(name, lim, figures, time.perf_counter() - t0))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    (out / "limit_pacing.json").write_text(
        json.dumps({"label": "simulated", "rows": rows}, indent=1)
    )
    md = [
        "| case | old limit (tok/s) | pacing bound | new limit | binds | P (paced steps) "
        "| F·P (GPU-s) | recorded tok/s: share of old → new |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        shares = "; ".join(
            f"{p} {s['tokens_per_s']:,}: {100 * s['old']:.1f} → {100 * s['new']:.1f} %"
            for p, s in r["shares"].items()
        )
        pace = r["pacing_bound_tokens_per_s"]
        md.append(
            f"| {r['case']} | {r['old_limit_tokens_per_s']:,.0f} | "
            f"{'—' if pace is None else f'{pace:,.0f}'} | {r['new_limit_tokens_per_s']:,.0f} | "
            f"{r['binding']} | {r['paced_steps']:,} | {r['paced_gpu_s']:,.1f} | {shares or '—'} |"
        )
    (out / "limit_pacing.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
