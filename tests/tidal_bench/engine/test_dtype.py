"""`tidal bench dtype`: fresh calibrations of a model's dtype, each run's pick and whether they
agree, as text and JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tidal_bench.engine import dtype


def test_runs_the_calibration_afresh_and_says_whether_the_picks_agree(
    tiny_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(next(iter(tiny_dirs.values())))
    out = tmp_path / "dtype.json"
    args = argparse.Namespace(model=model, runs=2, threads=1, json=str(out))
    assert dtype.run(args) == 0
    text = capsys.readouterr().out
    assert text.count("run ") == 2 and "picks: " in text
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2
    assert {r["dtype"] for r in report["runs"]} <= {"float32", "bfloat16"}
    assert all("measured" in r["reason"] for r in report["runs"])
