"""The torch co-location runs' offline limit (simulated) for each step profile, and each step
log against the limit's linear floor (`tidal.sim.limit.linear_floor`) and the fitted roofline.

    python docs/results/colocation/torch_limit_check.py \
        > docs/results/colocation/torch_limit_check.json   # from the repository root

The config is the quiet runs' (configs/embedded.yaml, prompts <= 256 and outputs <= 32 tokens,
5 + 20 s window, 3 % of online requests forgiven), `tidal`'s two instances on one engine core
and on one core each. Every figure is simulated (derived from a fitted step model)."""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

from tidal.perf import make_step_model
from tidal.perf.steplog import read_step_log
from tidal.schemas.enums import RequestClass
from tidal.sim.build import _step_model, kv_geometry, with_offline_rate, workload
from tidal.sim.limit import _costs, linear_floor
from tidal_bench.colocation.caps import MIX_QPS, window_limit
from tidal_bench.colocation.search import write_config

DIR = "docs/results/colocation/"
PROFILES = {
    "torch_steps_profile.json": "torch_steps.jsonl",
    "torch_steps_profile_1129.json": "torch_steps_1129.jsonl",
    "torch_steps_profile_batch128.json": "torch_steps_batch128.jsonl",
}
SETS = [
    "online.max_input_tokens=256",
    "online.max_output_tokens=32",
    "offline.max_input_tokens=256",
    "offline.max_output_tokens=32",
]


def config(profile: str):  # type: ignore[no-untyped-def]
    a = argparse.Namespace(
        config="configs/embedded.yaml", warmup_s=5, measure_s=20, set=[*SETS, f"profile={profile}"]
    )
    with tempfile.TemporaryDirectory() as t:
        cfg, _ = write_config(a, t)
    return cfg


def with_prefix_cache(profile: str) -> dict:
    """Offline alone on one core (simulated), every line's prompt charged only past its last
    full 16-token block (what the prefix cache left of the old "tide tide ..." prompts): the
    GEMM floor of the cached tokens taken off, everything else as charged. An illustration."""
    cfg = with_offline_rate(config(profile), MIX_QPS)
    f = linear_floor(_step_model(cfg.model, cfg.hardware, cfg.tp, cfg.latency_model, cfg.profile))
    _, blocks = kv_geometry(cfg)
    off = [r for r in workload(cfg) if r.req_class is RequestClass.OFFLINE]
    inp = np.array([r.input_tokens for r in off], dtype=float)
    out = np.array([r.output_tokens for r in off], dtype=float)
    left = inp - 16 * np.floor((inp - 1) / 16)
    saved = f.num_layers * f.per_token_s * (inp - left)
    full = max(  # the side the limit takes: the costlier
        _costs(f, inp, out, blocks * cfg.block_size, side)[0].sum() for side in (True, False)
    )
    return {
        "mean_prompt_tokens": round(float(inp.mean()), 1),
        "mean_prompt_tokens_computed": round(float(left.mean()), 1),
        "offline_only_tokens_per_s_charged": round(float(out.sum() / full), 1),
        "offline_only_tokens_per_s_with_the_cache": round(
            float(out.sum() / (full - saved.sum())), 1
        ),
    }


def limits(profile: str) -> dict:
    cfg = config(profile)
    out = {}
    for name, dev in (("one_core", 1), ("one_core_an_instance", None)):
        lim = window_limit(cfg, "tidal", 3.0, 0, dev)
        out[name] = {
            "limit_tokens_per_s": round(lim.limit_tokens_per_s, 1),
            "offline_only_tokens_per_s": round(lim.offline_only_tokens_per_s, 1),
            "online_cpu_s": round(lim.online_gpu_s, 3),
            "offline_ms_per_token": round(lim.offline_s_per_token * 1e3, 3),
        }
    return out


def against_log(profile: str, log_path: str) -> dict:
    m = make_step_model("smollm2-135m", "cpu", tp=1, kind="roofline", profile=profile)
    f = linear_floor(m)
    log = read_step_log(log_path)
    floor = np.array(
        [
            min(
                f.step_floor_s(
                    b.num_tokens,
                    b.num_prefill_reqs + b.num_decode_reqs,
                    b.num_prefill_tokens,
                    b.prefill_attn_pairs,
                    b.num_decode_reqs,
                    b.decode_context_tokens,
                    side,
                )
                for side in (True, False)
            )
            for b in log.batches
        ]
    )
    pred = np.array([m.step_s(b) for b in log.batches])
    t, rows = log.step_s, np.array([b.num_decode_reqs for b in log.batches])
    return {
        "steps": len(t),
        "decode_rows_max": int(rows.max()),
        "decode_rows_mean": round(float(rows.mean()), 1),
        "steps_below_the_floor_pct": round(float(np.mean(t < floor)) * 100, 1),
        "floor_sum_over_measured_sum": round(float(floor.sum() / t.sum()), 3),
        "roofline_mape_pct": round(float(np.mean(abs(pred - t) / t)) * 100, 1),
        "roofline_sum_over_measured_sum": round(float(pred.sum() / t.sum()), 3),
    }


def main() -> None:
    out: dict = {"label": "simulated (limits from fitted step models; logs measured)"}
    for prof, own_log in PROFILES.items():
        out[prof] = {
            "limit": limits(DIR + prof),
            "on_its_own_log": against_log(DIR + prof, DIR + own_log),
            "on_the_batch128_log": against_log(DIR + prof, DIR + "torch_steps_batch128.jsonl"),
        }
    out["illustration_shared_prefix_prompts_one_core"] = with_prefix_cache(
        DIR + "torch_steps_profile_batch128.json"
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
