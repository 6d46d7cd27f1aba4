"""`tidal bench replay`'s table: each figure live, in the simulator with the window's serving
path, and (for reference) with the idle probe's and as configured."""

from __future__ import annotations

from typing import Any

# the simulator with the window's serving path, with the probe's, as configured
SIDES = ("live", "simulator", "simulator_probe", "simulator_uncalibrated")

KEYS = [
    ("slo_attainment_pct", "attain %", 1),
    ("ttft_p50_s", "TTFT p50 s", 3),
    ("ttft_p99_s", "TTFT p99 s", 3),
    ("tpot_p50_s", "TPOT p50 s", 4),
    ("tpot_p99_s", "TPOT p99 s", 4),
    ("offline_tokens_per_s", "offline tok/s", 1),
]


def print_table(report: dict[str, Any], label: str) -> None:
    """Both sides of every policy, one figure a line: `label` value, simulator value (with the
    window's serving path), the simulator's error against live (points for attainment, % of
    live otherwise), and for reference the simulator with the idle probe's path and as
    configured."""
    for policy, run_ in report["runs"].items():
        res, cal = run_["resources"], run_["calibration"]
        print(
            f"  {policy}  (both sides: {len(res['instances'])} instances "
            f"[{'; '.join(res['instances'])}], {res['kv_tokens_per_instance']} KV tokens each, "
            f"{res['cpu_attention_workers']} CPU-attention workers; KV shipped per token: "
            f"{res['kv_bytes_per_token_shipped']})"
        )
        print(
            f"    serving path (probe): dispatch {cal['dispatch_ms']:.1f} ms + "
            f"{cal['dispatch_us_per_token']:.2f} us/token; hand-off "
            f"{cal['link_latency_ms']:.1f} ms (of it {cal.get('handoff_delay_ms', 0.0):.1f} ms "
            f"before the source's export) + KV at {cal['link_gb_per_s']:.2f} GB/s"
        )
        kinds = run_["live"].get("migration_kinds") or {}
        if kinds:
            print(
                "    KV transfers in the window (live): "
                + "; ".join(
                    f"{k} {v['num_ok']} ok, {v['gb']:.2f} GB, data plane "
                    f"{v['gb'] / max(v['transfer_s'], 1e-9):.2f} GB/s"
                    for k, v in kinds.items()
                )
            )
        path = run_["live"].get("path") or {}
        if path.get("num_matched"):
            pin, pout = path["in_ms_p50_p90_p99"], path["out_ms_p50_p90_p99"]
            print(
                f"    serving path in the window (live, ms p50/p90/p99): client -> engine "
                f"{'/'.join(f'{v:.0f}' for v in pin)}; first token -> client "
                f"{'/'.join(f'{v:.0f}' for v in pout)}"
            )
        win = run_.get("window_calibration") or {}
        if win:
            what = [
                w
                for w, k in (("dispatch", "window_dispatch"), ("KV link rate", "window_link"))
                if win.get(k)
            ]
            print(
                f"    serving path the simulator gets (from the window: {', '.join(what) or 'none'}"
                f"): dispatch {win['dispatch_ms']:.1f} ms + {win['dispatch_us_per_token']:.2f} "
                f"us/token; hand-off {win['link_latency_ms']:.1f} ms + KV at "
                f"{win['link_gb_per_s']:.2f} GB/s"
            )
        for key, name, nd in KEYS:
            a, b, c, d = (run_.get(side, run_["simulator"])[key] for side in SIDES)
            print(
                f"    {name:14s} {label} {a:10.{nd}f}   sim {b:10.{nd}f}   {_diff(key, a, b):>9s}"
                f"   (sim with the probe's path {c:.{nd}f}, {_diff(key, a, c)}; "
                f"as configured {d:.{nd}f}, {_diff(key, a, d)})"
            )
        live = run_["live"]
        if "start_offset_s" in live:  # guidellm's load: how it was sent
            off = ", ".join(f"{c} +{s:.2f} s" for c, s in live["start_offset_s"].items())
            print(
                f"    (guidellm: dispatch lag p50/p99 {live['dispatch_lag_p50_s'] * 1e3:.1f}/"
                f"{live['dispatch_lag_p99_s'] * 1e3:.1f} ms; process start {off}; "
                f"unrecorded {live['unrecorded']}; errored/incomplete {live['failed']}; "
                f"prompt token counts off {live['prompt_tokens_mismatched']})"
            )
        elif "dispatch_lag_p50_s" in live:
            print(
                f"    (client: dispatch lag p50/p99 {live['dispatch_lag_p50_s'] * 1e3:.1f}/"
                f"{live['dispatch_lag_p99_s'] * 1e3:.1f} ms, not in TTFT)"
            )


def _diff(key: str, live: float, sim: float) -> str:
    """The simulator's error against live: points for attainment, else % of live."""
    if key.endswith("pct"):
        return f"{sim - live:+.1f} pt"
    return f"{(sim / live - 1) * 100:+.1f} %" if live else "n/a"
