from __future__ import annotations

import dataclasses
import json

import pytest

from tidal.perf.api import BatchShape
from tidal.perf.catalog import hardware_spec, model_spec
from tidal.perf.cli import main
from tidal.perf.factory import make_step_model
from tidal.perf.roofline import RooflineParams

from .conftest import write_vidur_csv

NS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048]


@pytest.fixture
def a100_csv(tmp_path):  # type: ignore[no-untyped-def]
    base = RooflineParams.from_hardware(hardware_spec("a100-80gb"))
    true = dataclasses.replace(base, F_g=230e12, M_g=1.8e12, O_k=6e-6, knee=2.0)
    path = tmp_path / "a100_llama.csv"
    write_vidur_csv(path, model_spec("llama-2-7b"), true, [1, 2, 4, 8], NS)
    return path


def test_validate_kernel_timings_reports_every_target(a100_csv, tmp_path, capsys) -> None:
    out = tmp_path / "v.json"
    assert main(["perf", "validate", "--kernel-timings", str(a100_csv), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["roofline_heldout_tokens"]["per_op_mape"] < 0.01  # data from a roofline
    assert res["roofline_cross_tp"]["per_op_mape"] < 0.01
    assert res["modulewise_dense_heldout_tokens"]["accuracy"] > 0.9
    assert res["roofline_datasheet_all_rows"]["per_op_mape"] > 0.05
    assert "roofline_heldout_tokens" in capsys.readouterr().out


def test_fit_then_use_the_profile(a100_csv, tmp_path) -> None:
    prof = tmp_path / "p.json"
    assert main(["perf", "fit", "--kernel-timings", str(a100_csv), "--out", str(prof)]) == 0
    m = make_step_model("llama-2-7b", "a100-80gb", tp=2, profile=prof)
    assert m.step_s(BatchShape(num_decode_reqs=8, decode_context_tokens=8000)) > 0
    out = tmp_path / "v.json"
    args = ["perf", "validate", "--kernel-timings", str(a100_csv), "--profile", str(prof)]
    assert main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["roofline_profile"]["per_op_mape"] < 1e-6


@pytest.mark.slow
def test_step_log_fit_validate_and_factory(a100_csv, tmp_path) -> None:
    log = tmp_path / "steps.jsonl"
    assert main(["perf", "synth-log", "--kernel-timings", str(a100_csv), "--out", str(log),
                 "--steps", "1500"]) == 0  # fmt: skip
    out = tmp_path / "v.json"
    assert main(["perf", "validate", "--log", str(log), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["heldout_steps"] > 200
    assert 0 < res["regression_mape"] < 0.2 and res["modulewise_accuracy"] > 0.8
    prof = tmp_path / "p.json"
    assert main(["perf", "fit", "--log", str(log), "--out", str(prof)]) == 0
    b = BatchShape(256, 1, 256 * 256, 32, 32 * 1000)
    for kind in ("regression", "modulewise"):
        assert make_step_model("llama-2-7b", "a100", kind=kind, profile=prof).step_s(b) > 0
    with pytest.raises(ValueError, match="profile"):
        make_step_model("llama-2-7b", "a100", kind="regression")
