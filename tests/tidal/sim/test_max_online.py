"""OOCO §5.2 step 1: the online scale calibration on a short slice of the OOCO config."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

from tidal.config.cluster import load_config
from tidal.sim.cli import main
from tidal.sim.search import max_online

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "ooco.yaml")


def test_max_online_finds_the_largest_scale_within_the_cap() -> None:
    cfg = replace(load_config(CONFIG), duration_s=120, drain_s=60)
    res = max_online(cfg, "base-pd", 1.0, start_scale=1.0, max_scale=16.0, iters=2)
    assert res.best_rate > 0 and res.best is not None
    assert res.best["online"]["violation_pct"] <= 1.0
    assert res.best["offline"]["num_requests"] == 0  # pure online serving
    # Every probe above the answer broke the cap; every probe at or below it met it.
    for x, s in res.probes:
        assert (s["online"]["violation_pct"] <= 1.0) == (x <= res.best_rate)
    # More scale, more online requests (OOCO §5.1.3 scaling).
    n = {x: s["online"]["num_requests"] for x, s in res.probes}
    xs = sorted(n)
    assert all(n[a] < n[b] for a, b in pairwise(xs))


def test_max_online_command_writes_summary(tmp_path: Path) -> None:
    out = tmp_path / "mo"
    argv = ["sim", "max-online", "--config", CONFIG, "--out", str(out), "--duration", "60"]
    rc = main([*argv, "--start-scale", "2", "--max-scale", "8", "--iters", "1"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["label"] == "simulated" and s["method"] == "max-online"
    assert s["policy"] == "base-pd" and len(s["probes"]) >= 2
    assert s["max_online_scale"] == 0 or s["online_violation_pct"] <= 1.0
