"""`tidal bench engine` end to end on a tiny checkpoint: both dtypes side by side, the engine's
dtype choice and the per-phase profile in the report and the JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tidal_bench.engine import run


def test_bench_engine_reports_both_dtypes_and_the_choice(
    tiny_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    monkeypatch.setenv("TIDAL_BF16_WEIGHT_ROWS", "0")  # no split: no third run
    parser = argparse.ArgumentParser()
    run._add_args(parser)
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_dirs["llama"]), "--batches", "1,2", "--prefill", "16"]
    argv += ["--rounds", "1", "--decode-steps", "2", "--prompt-len", "8", "--kv-tokens", "4096"]
    args = parser.parse_args([*argv, "--profile", "--json", str(out)])
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"float32", "bfloat16"}
    for r in res["runs"].values():
        assert r["decode_tokens_per_s"]["1"] > 0 and r["hf"]["decode"]["2"] > 0
        assert r["profile_batch1"]["wall_ms"] > 0 and "batch1_vs_hf" in r["targets"]
    assert (
        res["chosen"]["dtype"] in ("float32", "bfloat16") and "measured" in res["chosen"]["reason"]
    )
    # the roofline's bandwidth: the median of three read probes before the runs and after each
    probes = res["read_bandwidth_probes_gb_s"]
    assert len(probes) == 9 and min(probes) <= res["read_bandwidth_gb_s"] <= max(probes)
    for r in res["runs"].values():
        step = r["roofline_decode_step_ms"]["1"]
        assert step == pytest.approx(r["decode_step_bytes"]["1"] / res["read_bandwidth_gb_s"] / 1e6)
    text = capsys.readouterr().out
    assert "engine default dtype here" in text and "matmul gate_up" in text
    assert "read bandwidth" in text


def test_bench_engine_auto_runs_the_split_beside_plain_fp32(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TIDAL_DTYPE", "float32")
    monkeypatch.setenv("TIDAL_BF16_WEIGHT_ROWS", "1")
    parser = argparse.ArgumentParser()
    run._add_args(parser)
    out = tmp_path / "bench.json"
    argv = ["--model", str(tiny_dirs["llama"]), "--batches", "1,2", "--prefill", "16"]
    argv += ["--rounds", "1", "--decode-steps", "2", "--prompt-len", "8", "--kv-tokens", "4096"]
    args = parser.parse_args([*argv, "--dtype", "float32,auto", "--json", str(out)])
    assert args.func(args) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"float32", "auto"}
    assert runs["float32"]["bf16_weight_rows"] == 0 and runs["auto"]["bf16_weight_rows"] == 1
    assert runs["auto"]["dtype"] == "float32" and runs["auto"]["hf"] == runs["float32"]["hf"]
    # the roofline counts the bytes read: bf16 copies at one row, fp32 weights at two
    roof, plain = (runs[d]["roofline_decode_step_ms"] for d in ("auto", "float32"))
    assert roof["1"] < 0.6 * plain["1"] and roof["2"] == plain["2"]
