"""The three commands end to end on a small slice of the OOCO config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tidal.sim.cli import main, register

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "ooco.yaml")


def test_register_adds_sim_with_three_commands() -> None:
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    args = p.parse_args(["sim", "run", "--config", "c.yaml", "--out", "o"])
    assert callable(args.func)
    for cmd in ("max-offline", "goodput"):
        args = p.parse_args(["sim", cmd, "--config", "c", "--out", "o", "--policies", "a,b"])
        assert callable(args.func)


def test_run_writes_summary_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = main(
        [
            "sim",
            "run",
            "--config",
            CONFIG,
            "--out",
            str(out),
            "--duration",
            "60",
            "--policy",
            "online-priority",
            "--seed",
            "3",
        ]
    )
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["label"] == "simulated" and s["policy"] == "online-priority"
    assert s["online"]["num_requests"] > 100
    assert 0 <= s["online"]["slo_attainment_pct"] <= 100
    for f in s["plots"]:
        assert (out / f).stat().st_size > 1000
    rows = (out / "requests.csv").read_text().splitlines()
    assert rows[0].startswith("req_id,class,") and len(rows) > s["online"]["num_requests"]


@pytest.mark.slow
def test_max_offline_and_goodput(tmp_path: Path) -> None:
    out = tmp_path / "mo"
    rc = main(
        [
            "sim",
            "max-offline",
            "--config",
            CONFIG,
            "--out",
            str(out),
            "--duration",
            "30",
            "--policies",
            "base-pd,online-priority",
            "--violation",
            "3",
            "--iters",
            "1",
            "--start-qps",
            "1",
            "--jobs",
            "2",
        ]
    )
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    for pol in ("base-pd", "online-priority"):
        v = s["policies"][pol]
        assert v["max_offline_qps"] >= 0 and v["online_violation_pct"] <= 3
        assert len(v["probes"]) >= 2
    assert (out / "max_offline.png").exists()
    out = tmp_path / "gp"
    rc = main(
        [
            "sim",
            "goodput",
            "--config",
            CONFIG,
            "--out",
            str(out),
            "--duration",
            "30",
            "--policies",
            "base-pd",
            "--attainment",
            "90",
            "--iters",
            "1",
            "--set",
            "offline=null",
            "--start-rps",
            "2",
        ]
    )
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["policies"]["base-pd"]["goodput_rps"] >= 2


def test_bad_config_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nmodel: qwen2.5-7b\nhardware: a100\ninstances: []\nslo: {ttft_s: 1, tpot_s: 1}\n"
    )
    rc = main(["sim", "run", "--config", str(bad), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "instances" in capsys.readouterr().err
