"""`tidal bench checkpoint`: the four ways to preempt, on the torch engine (a tiny random Llama
here) and in the simulator, with the figures each must show: no copy and a short recompute with
checkpoints, everything copied at the preemption with swap, everything recomputed without."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tidal_bench.checkpoint import run as bench


def args(tmp_path: Path, model: str, **kw: object) -> argparse.Namespace:
    base = dict(
        requests=2, context=40, decode=20, after=3, model=model, device="cpu",
        dtype="float32", threads=1, skip_engine=False, live=False, own=False,
        steps_only=False,
        sim_model="qwen2.5-7b",
        sim_hardware="a100-80gb", pcie_gb_per_s=25.0, json=str(tmp_path / "ckpt.json"),
    )  # fmt: skip
    return argparse.Namespace(**(base | kw))


def test_checkpoints_free_without_copying_and_recompute_only_tails(
    tiny_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.run(args(tmp_path, str(tiny_dirs["llama"]))) == 0
    text = capsys.readouterr().out
    assert "measured" in text and "simulated" in text and "same tokens NO" not in text
    report = json.loads((tmp_path / "ckpt.json").read_text())
    for side in ("engine", "simulator"):
        by = {m["mode"]: m for m in report[side]["modes"]}
        # 2 requests of 40 + 20 decoded: 60 tokens of KV each when preempted
        assert by["recompute"]["tokens_recomputed"] == 2 * 60
        assert by["swap"]["tokens_recomputed"] == 0 and by["swap"]["host_bytes"] > 0
        # checkpointed through the last full block (48 of 60): 12 recomputed each (the copy
        # of that block was queued 12 steps before the preemption: done by then)
        for mode in ("checkpoint", "checkpoint-sync"):
            assert by[mode]["tokens_recomputed"] == 2 * 12
            assert by[mode]["host_bytes"] == by["swap"]["host_bytes"] * 48 // 60
            assert by[mode]["copy_ms"] > 0
        assert by["recompute"]["host_bytes"] == by["recompute"]["copy_ms"] == 0
    sim = {m["mode"]: m for m in report["simulator"]["modes"]}
    assert sim["checkpoint"]["free_ms"] == pytest.approx(0, abs=1e-9)  # no copy
    assert sim["swap"]["free_ms"] > 0.1  # 120 tokens of a 7B model's KV at 25 GB/s
    assert sim["checkpoint"]["resume_ms"] < sim["recompute"]["resume_ms"]
    # simulated: a copy beside the step hides under it; before it, it adds to it
    assert sim["checkpoint"]["first_step_ms"] < sim["checkpoint-sync"]["first_step_ms"]
    assert sim["checkpoint"]["mean_step_ms"] == pytest.approx(sim["recompute"]["mean_step_ms"])
    assert all(m["equal_to_uninterrupted"] for m in report["engine"]["modes"])
    side = {m["mode"]: m for m in report["engine"]["steps_side_by_side"]}
    assert set(side) == {"none", "checkpoint", "checkpoint-sync"}
    assert side["none"]["copy_ms"] == 0 < side["checkpoint"]["copy_ms"]
    assert side["checkpoint-sync"]["copy_ms"] > 0


def test_the_own_eviction_releases_with_checkpoints_and_recomputes_without(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    assert bench.run(args(tmp_path, str(tiny_dirs["llama"]), own=True)) == 0
    own = json.loads((tmp_path / "ckpt.json").read_text())["own"]
    assert own["torch"]["label"] == "measured" and own["sim"]["label"] == "emulated"
    for side in ("torch", "sim"):
        by = {m["mode"]: m for m in own[side]["modes"]}
        bare, ckpt = by["recompute"], by["checkpoint"]
        assert bare["releases"] == 0 < bare["recomputes"] and bare["host_bytes_peak"] == 0
        assert ckpt["recomputes"] == 0 < ckpt["releases"] and ckpt["host_bytes_peak"] > 0
        # a release loses the tail past its last full block; a recompute all of its KV
        assert ckpt["tokens_recomputed"] < 16 * ckpt["releases"]
        assert bare["tokens_recomputed"] >= 40 * bare["recomputes"]
        assert ckpt["online_ttft_ms"] > 0 and bare["online_ttft_ms"] > 0
    assert all(m["equal_to_uninterrupted"] for m in own["torch"]["modes"])


def test_bad_sizes_are_refused_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--context must be >= 1"):
        bench.run(args(tmp_path, "", context=0, skip_engine=True))


@pytest.mark.nats
def test_live_the_signal_releases_checkpointed_work_and_recomputes_the_rest(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # 2 requests of 40-word prompts preempted after 20 decoded tokens, on a live instance
    # (200 more after: a tiny model's request must not end before the signal reaches it)
    a = args(tmp_path, str(tiny_dirs["llama"]), skip_engine=True, live=True, after=200)
    assert bench.run(a) == 0
    live = json.loads((tmp_path / "ckpt.json").read_text())["live"]
    by = {m["mode"]: m for m in live["modes"]}
    assert by["checkpoint"]["how"] == ["release", "release"]
    assert by["recompute"]["how"] == ["recompute", "recompute"]
    # a release loses under two blocks of 16 each; a recompute everything (>= 60 tokens each)
    assert 0 <= by["checkpoint"]["tokens_lost"] < 2 * 32
    assert by["recompute"]["tokens_lost"] >= 2 * 60 > by["checkpoint"]["tokens_lost"]
    for m in by.values():
        assert m["freed_blocks"] >= 2 * 3 and 0 <= m["boundary_ms"] <= m["free_ms"]
