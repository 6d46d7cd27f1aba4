"""HyGen §5.2 in the simulator: HyGen*'s profiled QPS and HyGen's profiled budget, each the
largest within a tolerance on one aggregate metric over pure online serving (short slices of
configs/hygen-paper.yaml)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tidal.config.cluster import load_config
from tidal.config.tolerance import Tolerance
from tidal.sim.cli import main
from tidal.sim.tolerance import pure_online, tolerance_search

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "hygen-paper.yaml")


def test_both_searches_stay_within_the_tolerance_and_the_ratios_follow() -> None:
    cfg = replace(load_config(CONFIG), duration_s=90, drain_s=30)
    tol = Tolerance("tbt_mean", 0.5)
    ref = pure_online(cfg)
    assert ref["offline"]["num_requests"] == 0 and ref["online"]["num_requests"] > 0
    res = tolerance_search(
        cfg, tol, ref, start_qps=0.5, qps_iters=1, budget_range_s=(0.01, 0.1), budget_iters=1
    )
    # HyGen*: every probed offline QPS up to the answer met the tolerance, the first above failed.
    assert res.rate.best is not None and tol.meets(res.rate.best, ref)
    for x, s in res.rate.probes:
        if x <= res.rate.best_rate:
            assert tol.meets(s, ref)
    if not res.rate.saturated:
        assert any(not tol.meets(s, ref) for x, s in res.rate.probes if x > res.rate.best_rate)
    # HyGen: the profiled budget's run meets it; every larger budget probed did not.
    b = res.budget
    assert b.budget_s is not None and b.best is not None and tol.meets(b.best, ref)
    assert b.best["offline"]["tokens_per_s"] > 0
    assert all(not tol.meets(s, ref) for x, s in b.probes if x > b.budget_s)
    row = res.row()
    hy, star = b.best, res.rate.best
    total = hy["online"]["total_tokens_per_s"] + hy["offline"]["total_tokens_per_s"]
    assert row["total_vs_pure_online"] == pytest.approx(total / ref["online"]["total_tokens_per_s"])
    assert row["total_vs_pure_online"] > 1.0  # offline work was added
    if star["offline"]["tokens_per_s"] > 0:
        assert row["offline_vs_rate_policy"] == pytest.approx(
            hy["offline"]["tokens_per_s"] / star["offline"]["tokens_per_s"]
        )
    assert row["bound_s"] == pytest.approx(1.5 * ref["online"]["tbt_s"]["mean"])


def test_tolerance_command_writes_both_ratios(tmp_path: Path) -> None:
    out = tmp_path / "tol"
    argv = ["sim", "tolerance", "--config", CONFIG, "--out", str(out), "--duration", "60"]
    argv += ["--set", "drain_s=20", "--tolerance", "tbt_p99=0.1", "--iters", "1"]
    assert main([*argv, "--start-qps", "1", "--budget-range", "0.02,0.08"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["label"] == "simulated" and s["config"] == "hygen-paper"
    (row,) = s["tolerances"]
    assert row["tolerance"] == "tbt_p99=0.1"
    assert (
        row["rate_policy"]["policy"] == "hygen-star" and row["budget_policy"]["policy"] == "hygen"
    )
    assert s["best"]["total_vs_pure_online"] == row["total_vs_pure_online"]


def test_budget_profiled_at_each_setting_and_the_most_offline_kept(tmp_path: Path) -> None:
    out = tmp_path / "tol"
    argv = ["sim", "tolerance", "--config", CONFIG, "--out", str(out), "--duration", "60"]
    argv += ["--set", "drain_s=20", "--tolerance", "ttft_p99=0.08", "--iters", "1"]
    argv += ["--start-qps", "1", "--budget-range", "0.02,0.05"]
    assert main([*argv, "--best-of", "hygen.online_prefill_budgeted=true,false"]) == 0
    s = json.loads((out / "summary.json").read_text())
    hy = s["tolerances"][0]["budget_policy"]
    (other,) = hy["other_settings"]
    settings = {hy["setting"], other["setting"]}
    assert settings == {"online_prefill_budgeted=True", "online_prefill_budgeted=False"}
    assert hy["offline_tokens_per_s"] >= other["offline_tokens_per_s"]
    assert other["probes"]  # the losing setting's search is kept too
    assert main([*argv, "--best-of", "hygen-star.offline_qps_cap=1,2"]) == 2


def test_tolerance_command_rejects_a_bad_range(tmp_path: Path) -> None:
    argv = ["sim", "tolerance", "--config", CONFIG, "--out", str(tmp_path / "x")]
    assert main([*argv, "--budget-range", "0.2,0.1"]) == 2
    assert main([*argv, "--tolerance", "tpot=0.1"]) == 2
