"""`tidal sim max-offline` with the offline limit and `--best-of`, on a small slice of OOCO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.sim.cli import main

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "ooco.yaml")


def test_max_offline_reports_share_of_limit_and_the_best_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mo"
    argv = ["sim", "max-offline", "--config", CONFIG, "--out", str(out), "--duration", "30"]
    argv += ["--policies", "online-priority,tidal", "--iters", "1", "--start-qps", "2"]
    argv += ["--best-of", "online-priority.max_decode_batch=8,128"]
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    lim = s["limit"]
    assert lim["label"] == "simulated"
    assert 0 < lim["tokens_per_s"] < lim["offline_only_tokens_per_s"]
    assert 0 < lim["online_gpu_s"] < lim["gpu_s"] == 2 * 30
    op = s["policies"]["online-priority"]
    tried = op["best_of"]["tried"]
    assert set(tried) == {"max_decode_batch=8", "max_decode_batch=128"}
    best = max(tried, key=lambda k: tried[k]["max_offline_tokens_per_s"])
    assert op["best_of"]["chosen"] == best
    assert op["max_offline_tokens_per_s"] == tried[best]["max_offline_tokens_per_s"]
    for pol in ("online-priority", "tidal"):
        v = s["policies"][pol]
        assert v["limit_tokens_per_s"] == lim["tokens_per_s"]
        assert v["share_of_limit"] == pytest.approx(
            v["max_offline_tokens_per_s"] / lim["tokens_per_s"]
        )
        assert 0 < v["share_of_limit"] <= 1
    assert "best_of" not in s["policies"]["tidal"]
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at 80 columns
    assert "[simulated] limit:" in err and f"[best of: {best}]" in err
    assert "% of the limit" in err
    # the smaller of its two bounds, named, with the steps the SLO pace forces
    assert lim["binding"] in ("kv", "pacing") and lim["paced_steps"] > 0
    assert lim["tokens_per_s"] == min(
        lim["kv_bound_tokens_per_s"], lim["pacing_bound_tokens_per_s"] or float("inf")
    )
    assert f"{lim['paced_steps']} paced steps" in err and "bound by" in err


def test_best_of_a_policy_not_searched_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "max-offline", "--config", CONFIG, "--out", str(tmp_path), "--duration", "5"]
    argv += ["--policies", "tidal", "--best-of", "online-priority.max_decode_batch=8"]
    assert main(argv) == 2
    assert "not in --policies" in capsys.readouterr().err


def test_best_of_an_unknown_param_fails_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "max-offline", "--config", CONFIG, "--out", str(tmp_path / "o")]
    argv += ["--policies", "online-priority", "--best-of", "online-priority.bogus=1,2"]
    assert main(argv) == 2
    assert "unknown key(s) ['bogus']" in capsys.readouterr().err
    assert not (tmp_path / "o" / "summary.json").exists()
