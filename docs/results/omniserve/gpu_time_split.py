"""Where the GPU time of an `omniserve` run goes (simulated): for every step the policy plans,
the step model's time of the whole step, of the step without its BE decodes, and of its LS work
alone, summed over the run; and, averaged over those steps, the free share of the instance's GPU
KV and its BE decodes resident on the GPU. The BE-decode share bounds what CPU attention can give
back to BE prefill. Usage (from the repository root):

    .venv/bin/python docs/results/omniserve/gpu_time_split.py [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import tidal.policy.omniserve.policy as omni
from tidal.perf.api import BatchShape
from tidal.policy.base import StepPlan
from tidal.policy.batch_shape import add_decode, add_prefill
from tidal.policy.state import InstanceState
from tidal.sim.build import simulate
from tidal.config.cluster import load_config


def _shape(inst: InstanceState, plan: StepPlan, be_decode: bool, be_prefill: bool) -> BatchShape:
    reqs = {r.req_id: r for r in (*inst.running, *inst.waiting)}
    s = BatchShape()
    for rid, n in plan.prefill.items():
        r = reqs[rid]
        if r.is_online or be_prefill:
            s = add_prefill(s, n, r.num_computed_tokens)
    for rid in plan.decode:
        r = reqs[rid]
        if r.is_online or be_decode:
            s = add_decode(s, 1, r.num_computed_tokens)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/omniserve.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    cfg = load_config(args.config, tuple(args.set))
    acc: dict[str, float] = defaultdict(float)
    inner = omni.omni_step

    def counted(inst: InstanceState, *a: Any) -> StepPlan:
        plan = inner(inst, *a)
        if plan.prefill or plan.decode:
            m = inst.step_model
            full = m.step_s(_shape(inst, plan, True, True))
            no_be_dec = m.step_s(_shape(inst, plan, False, True))
            ls = m.step_s(_shape(inst, plan, False, False))
            acc["step_s"] += full
            acc["be_decode_s"] += full - no_be_dec
            acc["be_prefill_s"] += no_be_dec - ls
            acc["ls_s"] += ls
            acc["steps"] += 1
            acc["free_kv"] += inst.num_free_blocks / inst.num_blocks
            acc["be_resident"] += sum(1 for r in inst.running if not r.is_online and r.is_decoding)
        return plan

    omni.omni_step = counted  # type: ignore[assignment]
    simulate(cfg, "omniserve")
    t = acc["step_s"]
    share = {k: round(v / t, 4) for k, v in acc.items() if k.endswith("_s") and k != "step_s"}
    n = acc["steps"]
    out = {
        "label": "simulated",
        "gpu_time_share": share,
        "mean_step_s": round(t / n, 4),
        "mean_free_gpu_kv_fraction": round(acc["free_kv"] / n, 3),
        "mean_be_decodes_on_gpu_per_instance": round(acc["be_resident"] / n, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
