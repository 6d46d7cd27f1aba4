"""The simulator's side of a torch-engine live max-offline report, run again (emulated).

    python docs/results/colocation/torch_sim.py docs/results/colocation/torch.json \
        [--profile docs/results/colocation/torch_steps_profile.json]

Without `--profile`: the simulator as `tidal bench colocation` runs it beside the live search
(the config's CPU roofline, whose numpy-measured peak is not this machine's torch engine), e.g.
after the simulator's counting changed. With `--profile` (`tidal perf fit --log` on a step log
the torch engine recorded on one core): the same search with step times fitted to the engine's
measured steps (`latency_model` and `profile` set in the simulator's config only; the live
stack's policies kept the config's roofline), stored as `simulator_measured_steps`. The report
is rewritten in place, plot included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tidal_bench.colocation import search as cs
from tidal_bench.colocation.report import plot, table


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("report")
    ap.add_argument("--profile", default="", help="tidal-perf-profile JSON of the torch engine")
    ap.add_argument("--kind", default="regression", choices=("regression", "roofline"))
    a = ap.parse_args(argv)
    report = json.loads(Path(a.report).read_text())
    s = report["search"]
    args = argparse.Namespace(
        config=report["config"],
        set=report["set"],
        warmup_s=report["warmup_s"],
        measure_s=report["measure_s"],
        violation=report["violation"],
        start_qps=s["start_qps"],
        max_qps=s["max_qps"],
        iters=s["iters"],
        batch_max_inflight=report.get("batch_max_inflight", 32),
    )
    cfg, _ = cs.write_config(args, cs.temp_dir())
    if a.profile:
        cfg = dataclasses.replace(cfg, latency_model=a.kind, profile=a.profile)
    for name, e in report["policies"].items():
        policy = name.split("/")[0]
        sim = cs.simulated(cfg, policy, args, e["resources"]["cpu_attn_workers_usable"])
        if a.profile:
            sim["step_times"] = f"{a.kind} fitted to {a.profile}"
            e["simulator_measured_steps"] = sim
        else:
            e["simulator"] = sim
            e["sim_max_offline_tokens_per_s"] = sim["max_offline_tokens_per_s"]
        print(f"{name}: {sim['max_offline_tokens_per_s']:.1f} tok/s at {sim['max_offline_qps']}")
    Path(a.report).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, report.get("plot") or str(Path(a.report).with_suffix(".png")))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
