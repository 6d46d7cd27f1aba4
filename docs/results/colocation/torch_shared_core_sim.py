"""The simulator beside the torch co-location runs of 2026-11-29 (`--search-offline`, engines on
core 0: `torch_own_limit_distinct_{tidal2,oprio2,ooco2}.json`), with each instance on a device
of its own (as the runs' own simulator column) and with both on one shared core, as the live
engines run (`num_devices: 1`, processor sharing, `tidal.sim.sharing`; what the bench's
simulator does now, `tidal_bench.colocation.sim_side.sim_config`, each shared step slowed by
the contention factor stored with the step profile, `shared_device_slowdown`, measured by
`python -m tidal_bench.colocation.shared_core`), and on the shared core with a perfect time
share (`shared_c1`: the factor left at 1, as before it was measured). Per policy and load: offline
tok/s, lines/s done, online attainment and TPOT p99 over the measured 20 s, counted as the live
windows are (`sim_window`); at 4 lines/s, the steps by kind per instance, as
`scripts/tlive4_diag/analyze.py` sums the live ones, and each online request's hand-off (its
first token to its next). A diagnostic beside them (`sensitivity`, not a setting anywhere):
the shared runs with a perfect time share at 4 lines/s with every step `f` times its profile's
time, f = 1.03 (the strict
instance's measured / predicted alone, docs/colocation.md) and 1.05 (the live steps' 2.05-2.13x
while both stepped, over the simulator's 2.0x); and `tidal` on the shared core with its
measured step-time scale not fed (`without_scale_feed`: left at 1, as before the live fix).
Every figure is simulated.

    PYTHONPATH=. python docs/results/colocation/torch_shared_core_sim.py \
        > docs/results/colocation/torch_shared_core_sim.json   # from the repository root
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections import defaultdict
from typing import Any

import tidal.sim.build as build
import tidal.sim.core as core
from tidal.sim.resume import fixed_s
from tidal.sim.sharing import DeviceShare
from tidal_bench.colocation.search import write_config
from tidal_bench.colocation.sim_side import sim_config, sim_window

DIR = "docs/results/colocation/"
RUNS = {"tidal": "tidal2", "online-priority": "oprio2", "ooco": "ooco2"}
LOADS = (2.0, 4.0, 8.0, 16.0)  # the search's probes (4, 8, 16) and one below
STEPS_AT = 4.0
SENSITIVITY = (1.03, 1.05)  # diagnostic: every step this many times its profile's time


class Scaled:
    """A step model whose every step takes `f` times the wrapped one's."""

    def __init__(self, model: Any, f: float) -> None:
        self.model, self.f = model, f

    def step_s(self, shape: Any) -> float:
        return self.f * self.model.step_s(shape)

    def fixed_s(self, shape: Any) -> float:
        return self.f * fixed_s(self.model, shape)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def scaled_window(cfg: Any, policy: str, load: float, warmup_s: float, f: float) -> Any:
    """`sim_window` with every step `f` times its profile's time (diagnostic)."""
    plain = build._step_model
    build._step_model = lambda *a: Scaled(plain(*a), f)  # type: ignore[assignment]
    try:
        return sim_window(cfg, policy, load, warmup_s)
    finally:
        build._step_model = plain


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


class StepLog:
    """Every step the simulator ends: (instance, role, start, end, time alone, what it ran),
    and each online request's hand-off; `finish_span` wrapped, as the live sitecustomize."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.handoffs: list[float] = []
        self.sharing: DeviceShare | None = None
        self._finish = core.finish_span
        self._init = DeviceShare.__init__

    def __enter__(self) -> StepLog:
        log = self

        def init(share: DeviceShare, *a: Any, **kw: Any) -> None:
            log._init(share, *a, **kw)
            log.sharing = share

        def finish(inst, span, now, rec, cuts=None):  # type: ignore[no-untyped-def]
            log.record(inst, span)
            return log._finish(inst, span, now, rec, cuts)

        DeviceShare.__init__ = init  # type: ignore[method-assign]
        core.finish_span = finish  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        DeviceShare.__init__ = self._init  # type: ignore[method-assign]
        core.finish_span = self._finish

    def record(self, inst: Any, span: Any) -> None:
        fl = self.sharing._flights.get(inst.instance_id) if self.sharing else None
        alone = fl.alone if fl is not None else [b - span.start_s for b in span.bounds]
        for r in span.decode:
            if r.is_online and r.num_output_tokens == 1 and r.first_token_s is not None:
                self.handoffs.append(span.bounds[0] - r.first_token_s)
        pre_on = sum(m for r, m in span.prefill if r.is_online)
        pre_off = sum(m for r, m in span.prefill if not r.is_online)
        dec_on = sum(1 for r in span.decode if r.is_online)
        t, a = span.start_s, 0.0
        for j in range(span.k):
            first = j == 0
            self.steps.append(
                {
                    "id": inst.instance_id,
                    "role": inst.role.value,
                    "start_s": t,
                    "end_s": span.bounds[j],
                    "alone_s": alone[j] - a,
                    "cut": bool(span.cut_layer),
                    "pre_on": pre_on if first else 0,
                    "pre_off": pre_off if first else 0,
                    "dec_on": dec_on,
                    "dec_off": len(span.decode) - dec_on,
                }
            )
            t, a = span.bounds[j], alone[j]


def steps_summary(log: StepLog, warmup_s: float, end_s: float) -> dict[str, Any]:
    kinds = {
        "offline prefill": lambda e: e["pre_off"] > 0,
        "decode only": lambda e: not e["pre_off"] and not e["pre_on"],
        "online prefill": lambda e: e["pre_on"] > 0,
    }
    out: dict[str, Any] = {}
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in log.steps:
        if warmup_s <= e["end_s"] < end_s and not e["cut"]:
            by[e["id"]].append(e)
    for iid, v in sorted(by.items()):
        per: dict[str, Any] = {
            "role": v[0]["role"],
            "num_steps": len(v),
            "busy_s": round(sum(e["end_s"] - e["start_s"] for e in v), 2),
        }
        for kind, sel in kinds.items():
            xs = [e for e in v if sel(e)]
            if not xs:
                continue
            real = [e["end_s"] - e["start_s"] for e in xs]
            alone = [e["alone_s"] for e in xs]
            ratio = [r / a for r, a in zip(real, alone, strict=True) if a > 0]
            per[kind] = {
                "n": len(xs),
                "ms_p50_p90_max": [round(1e3 * x, 1) for x in (q(real, 0.5), q(real, 0.9), max(real))],
                "alone_ms_p50": round(1e3 * q(alone, 0.5), 1),
                "over_alone_p10_p50_p90": [round(q(ratio, p), 2) for p in (0.1, 0.5, 0.9)],
                "sum_over_sum_alone": round(sum(real) / sum(alone), 3),
                "offline_prefill_tokens_p50_max": [q([e["pre_off"] for e in xs], 0.5), max(e["pre_off"] for e in xs)],
                "online_decodes_p50_max": [q([e["dec_on"] for e in xs], 0.5), max(e["dec_on"] for e in xs)],
                "offline_decodes_p50_max": [q([e["dec_off"] for e in xs], 0.5), max(e["dec_off"] for e in xs)],
            }
        out[f"instance-{iid}"] = per
    h = log.handoffs
    out["online_handoff_ms_p50_max"] = [round(1e3 * q(h, 0.5)), round(1e3 * max(h))] if h else None
    return out


def without_scale_feed(cfg: Any, policy: str, load: float, warmup_s: float) -> Any:
    """`sim_window` with no instance's `step_time_scale` fed (it stays 1; diagnostic)."""
    ended = DeviceShare.ended
    DeviceShare.ended = lambda share, inst, span: share._flights.pop(inst.instance_id, None)  # type: ignore[method-assign]
    try:
        return sim_window(cfg, policy, load, warmup_s)
    finally:
        DeviceShare.ended = ended  # type: ignore[method-assign]


def main() -> None:
    report: dict[str, Any] = {
        "label": "simulated",
        "what": "the simulator on the torch co-location runs' settings, own device vs shared core",
    }
    for policy, tag in RUNS.items():
        run = json.load(open(f"{DIR}torch_own_limit_distinct_{tag}.json"))
        res = run["policies"][policy]["resources"]
        args = argparse.Namespace(
            config=run["config"],
            set=run["set"],
            warmup_s=run["warmup_s"],
            measure_s=run["measure_s"],
            engine=run["engine"],
            engine_cores=res["engine_cores"],
        )
        with tempfile.TemporaryDirectory() as t:
            cfg, _ = write_config(args, t)
        cfg = dataclasses.replace(
            cfg,
            cpu_workers=dataclasses.replace(cfg.cpu_workers, count=res["cpu_attn_workers_usable"]),
            batch_max_inflight=res["batch_max_inflight"],
        )
        live = {p["offline_qps"]: p for p in run["policies"][policy]["probes"]}
        shared = sim_config(args, cfg, policy)
        c1 = dataclasses.replace(shared, shared_device_slowdown=1.0)
        sides = {"own": cfg, "shared": shared, "shared_c1": c1}
        rows = []
        for load in LOADS:
            row: dict[str, Any] = {"offline_qps": load}
            if load in live:
                p = live[load]
                row["live"] = {
                    "offline_tokens_per_s": p["offline_tokens_per_s"],
                    "offline_lines_per_s": p["offline_lines_per_s"],
                    "attainment_pct": p["attainment_pct"],
                }
            for side, c in sides.items():
                with StepLog() as log:
                    m = sim_window(c, policy, load, args.warmup_s)
                row[side] = {
                    "num_devices": c.num_devices,
                    "shared_device_slowdown": c.shared_device_slowdown,
                    "offline_tokens_per_s": round(m.offline_tokens_per_s, 2),
                    "offline_lines_per_s": round(m.offline_lines_per_s, 3),
                    "attainment_pct": round(m.attainment_pct, 1),
                    "tpot_p99_ms": round(1e3 * m.tpot_p99_s, 1),
                    "ttft_p99_ms": round(1e3 * m.ttft_p99_s, 1),
                }
                if "live" in row and m.offline_tokens_per_s > 0:
                    live_tok = row["live"]["offline_tokens_per_s"]
                    row[side]["live_over_sim"] = round(live_tok / m.offline_tokens_per_s, 3)
                if load == STEPS_AT:
                    row[side]["steps"] = steps_summary(log, args.warmup_s, cfg.duration_s)
            rows.append(row)
        live_tok = live[STEPS_AT]["offline_tokens_per_s"]
        sens = []
        for f in SENSITIVITY:
            m = scaled_window(sides["shared_c1"], policy, STEPS_AT, args.warmup_s, f)
            sens.append(
                {
                    "step_time_factor": f,
                    "offline_tokens_per_s": round(m.offline_tokens_per_s, 2),
                    "offline_lines_per_s": round(m.offline_lines_per_s, 3),
                    "attainment_pct": round(m.attainment_pct, 1),
                    "live_over_sim": round(live_tok / m.offline_tokens_per_s, 3),
                }
            )
        report[policy] = {
            "run": f"torch_own_limit_distinct_{tag}.json",
            "loads": rows,
            "sensitivity_at_4_shared_c1": sens,
        }
        if policy == "tidal":
            for side in ("shared", "shared_c1"):
                m = without_scale_feed(sides[side], policy, STEPS_AT, args.warmup_s)
                report[policy][f"without_scale_feed_at_4_{side}"] = {
                    "offline_tokens_per_s": round(m.offline_tokens_per_s, 2),
                    "offline_lines_per_s": round(m.offline_lines_per_s, 3),
                    "attainment_pct": round(m.attainment_pct, 1),
                    "tpot_p99_ms": round(1e3 * m.tpot_p99_s, 1),
                }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
