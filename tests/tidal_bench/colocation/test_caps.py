"""The live search's caps derived from the load: lines in flight from the KV pools and the offline
mix, the largest QPS from the computed offline limit, explicit values kept, and the limit's basis
named."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tidal.config.cluster import ClusterConfig
from tidal.sim.limit import config_limit
from tidal_bench.colocation import caps
from tidal_bench.colocation import search as cs


def _cfg(tmp_path: Path, *sets: str, config: str = "configs/ooco.yaml") -> ClusterConfig:
    args = argparse.Namespace(config=config, set=list(sets), warmup_s=4.0, measure_s=10.0)
    cfg, _ = cs.write_config(args, str(tmp_path))
    return cfg


def test_lines_in_flight_fill_the_kv_pools_at_the_mixs_mean_footprint() -> None:
    mix = caps.Mix(lines=100, mean_input_tokens=1000.0, mean_output_tokens=200.0)
    assert caps.lines_in_flight(2 * 600_000, mix) == 1000  # 1.2 M tokens / 1,200 a line
    assert caps.lines_in_flight(1201, mix) == 2  # rounded up
    assert caps.lines_in_flight(10, mix) == 1  # never below one line
    with pytest.raises(ValueError, match="KV"):
        caps.lines_in_flight(0, mix)


def test_the_largest_qps_is_past_the_limits_lines_a_second_by_the_margin() -> None:
    mix = caps.Mix(lines=100, mean_input_tokens=1000.0, mean_output_tokens=200.0)
    assert caps.max_qps_from_limit(4000.0, mix) == 30.0  # 1.5 x 20 lines/s
    assert caps.max_qps_from_limit(4100.0, mix, margin=1.0) == 21.0  # 20.5, rounded up
    with pytest.raises(ValueError, match="--max-qps"):
        caps.max_qps_from_limit(0.0, mix)


def test_derived_caps_on_the_sim_engine_config(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "offline.max_output_tokens=256")
    spec = cfg.step_model_spec()
    got = caps.derive(cfg, ["online-priority", "ooco", "tidal"], "sim", spec, 3.0, 0, 1_082_560,
                      None, None)  # fmt: skip
    mix = got["offline_mix"]
    assert mix["mean_output_tokens"] <= 256 and mix["lines"] == 64 * 14
    footprint = mix["mean_input_tokens"] + mix["mean_output_tokens"]
    # both instances' pools, whole lines: far past the 32 or 128 lines earlier runs fixed
    assert got["batch_max_inflight"] == -(-2 * 1_082_560 // footprint)
    assert got["batch_max_inflight"] > 1000
    lim = config_limit(
        dataclasses.replace(cfg, cpu_workers=dataclasses.replace(cfg.cpu_workers, count=0)),
        "tidal",
        3.0,
        caps.MIX_QPS,
    ).limit_tokens_per_s
    # no schedule completes more than the limit: 1.5x its lines/s saturates every policy
    assert got["max_qps"] * mix["mean_output_tokens"] >= 1.5 * lim
    assert got["max_qps"] - 1 < 1.5 * lim / mix["mean_output_tokens"]
    assert "same step model on both sides" in got["basis"]
    assert "offline limit" in got["max_qps_from"] and "KV tokens" in got["batch_max_inflight_from"]


def test_explicit_caps_are_kept(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    got = caps.derive(cfg, ["ooco"], "sim", cfg.step_model_spec(), 3.0, 0, 1000, 32, 16.0)
    assert (got["batch_max_inflight"], got["max_qps"]) == (32, 16.0)
    assert got["batch_max_inflight_from"] == "--batch-max-inflight"
    assert got["max_qps_from"] == "--max-qps"


def test_the_limits_basis_is_named_for_each_engine_and_step_model(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert "a different step model" in caps.limit_basis("sim", "linear", cfg)
    assert "torch engine's own steps" in caps.limit_basis("torch", "", cfg)
    fitted = dataclasses.replace(cfg, profile="steps.json")
    assert "calibrated by steps.json" in caps.limit_basis("torch", "", fitted)


def test_a_config_off_the_roofline_needs_an_explicit_max_qps(tmp_path: Path) -> None:
    cfg = dataclasses.replace(_cfg(tmp_path), latency_model="regression")
    with pytest.raises(ValueError, match="pass --max-qps"):
        caps.derive(cfg, ["ooco"], "sim", "linear", 3.0, 0, 1000, 32, None)
    # with --max-qps given, nothing needs the limit
    assert caps.derive(cfg, ["ooco"], "sim", "linear", 3.0, 0, 1000, None, 8.0)["max_qps"] == 8.0


def test_the_live_engines_devices_are_their_cores_on_torch_and_one_an_instance_on_sim() -> None:
    assert caps.engine_devices("sim", (0,), 2) is None  # emulated steps: one device an instance
    assert caps.engine_devices("torch", (0,), 2) == 1
    assert caps.engine_devices("torch", (0, 1, 3), 8) == 3
    assert caps.engine_devices("torch", None, 2) == 2  # unpinned: every host core
