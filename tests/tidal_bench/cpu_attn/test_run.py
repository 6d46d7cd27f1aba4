"""`tidal bench cpu-attn`: its core lists are checked before anything starts, the bandwidth bound
arithmetic, and the on-core measurement on this machine (tiny sizes)."""

from __future__ import annotations

import os

import pytest

from services.cli.main import main
from tidal_bench.cpu_attn import bound


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--engine-cores", "0", "--cpu-attn-cores", "0"], "share core(s) 0"),
        (["--cpu-attn-cores", "4096"], "--cpu-attn-cores '4096': core(s) 4096 not available"),
        (["--engine-cores", "x"], "'x' is not a core or a range"),
    ],
)
def test_bad_cores_fail_before_any_stack_starts(
    capsys: pytest.CaptureFixture[str], argv: list[str], why: str
) -> None:
    assert main(["bench", "cpu-attn", *argv]) == 2
    assert why in capsys.readouterr().out


def test_live_bound_per_step_arithmetic() -> None:
    # 2 frames of 10 rows over 1000 context tokens each: per frame 10_000 tokens x 768 B
    # (2 x 3 KV heads x 64 x 2 B) = 7.68 MB; a step is 30 frames = 230.4 MB; at 10 GB/s that
    # streams in 23.04 ms; 0.01 s per frame is 300 ms a step, 13x the bound.
    live = {"worker_attn_frames": 2, "worker_ctx_tokens": 20_000, "worker_attn_s": 0.02}
    got = bound.live_bound(live | {"worker_attn_rows": 20}, 10.0, "bfloat16")
    assert got == {
        "attn_ms_per_step": 300.0,
        "kv_mb_per_step": 230.4,
        "bound_ms_per_step": 23.04,
        "x_bound": 13.0,
        "rows_per_frame": 10.0,
    }
    assert bound.live_bound({"worker_attn_frames": 0}, 10.0, "bfloat16")["attn_ms_per_step"] is None


def test_measure_runs_on_the_given_core_and_restores_the_mask() -> None:
    mine = os.sched_getaffinity(0)
    core = max(mine)
    got = bound.measure([core], num_rows=2, context_tokens=64, dtype="bfloat16")
    assert os.sched_getaffinity(0) == mine
    assert got["cores"] == str(core) and got["threads"] == 1
    assert got["copy_gb_per_s"] > 0
    iso = got["isolated"]
    assert iso["kv_kb_per_frame"] == round(2 * (64 + 10) * 768 / 1e3, 1)  # rows x ctx x B
    assert iso["us_per_frame"] > 0 and iso["bound_us_per_frame"] > 0
