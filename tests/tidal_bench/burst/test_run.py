"""`tidal bench burst` on the live stack: the stack it starts gets the simulator's cluster, and
one tiny run on the embedded stack (sim engine) completes every line of its job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.main import main
from tidal.config.cluster import load_config
from tidal_bench.burst.run import up_args
from tidal_bench.burst.schedule import BurstSchedule
from tidal_bench.burst.simulated import kv_tokens_per_instance, sim_config

SCHED = BurstSchedule(
    high_rate=4.0,
    low_rate=1.0,
    phase_s=5.0,
    cycles=2,
    prompt_tokens=64,
    output_tokens=16,
    jobs=1,
    lines=10,
    line_prompt_tokens=128,
    line_output_tokens=32,
)


def test_the_live_stack_gets_the_simulators_kv_pool_and_batch_cap() -> None:
    cfg = sim_config(load_config("configs/ooco.yaml"), SCHED, job_timeout_s=60.0)
    assert cfg.cpu_workers.count == 0 and cfg.batch_max_inflight == 32
    assert (cfg.duration_s, cfg.drain_s) == (20.0, 60.0)  # 2 cycles x 2 phases x 5 s
    up = up_args(cfg, "configs/ooco.yaml", "ooco", SCHED)
    opt = dict(zip(up[::2], up[1::2], strict=True))
    assert opt["--engine"] == "sim" and opt["--policy"] == "ooco" and opt["--cpu-attn"] == "0"
    assert opt["--sim-step-model"] == "qwen2.5-7b@a100-80gb"
    assert int(opt["--kv-cache-tokens"]) == kv_tokens_per_instance(cfg, "ooco") > 0
    assert opt["--max-model-len"] == str(128 + 32 + 16)  # the longest request, plus room
    assert opt["--batch-max-inflight"] == "32"


@pytest.mark.e2e
@pytest.mark.nats
@pytest.mark.slow
def test_a_tiny_burst_run_on_the_sim_engine_completes_every_line(tmp_path: Path) -> None:
    out, png = tmp_path / "burst.json", tmp_path / "burst.png"
    argv = ["bench", "burst", "--policies", "tidal", "--phase-s", "5", "--cycles", "2"]
    argv += ["--jobs", "1", "--lines", "10", "--prompt-tokens", "64", "--output-tokens", "16"]
    argv += ["--line-prompt-tokens", "128", "--line-output-tokens", "32"]
    argv += ["--job-timeout-s", "60", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    live = report["runs"]["tidal"]["live"]
    assert "emulated" in live["label"]
    assert live["all_lines_done"] and live["num_lines_lost"] == 0
    (job,) = live["jobs"]
    assert job["status"] == "completed" and job["num_results"] == 10
    assert job["curve"][-1][1] == 10 and job["completed_s"] >= job["curve"][-1][0]
    assert [p["kind"] for p in live["phases"]] == ["burst", "trough", "burst", "trough"]
    sent = [p["num_sent"] for p in live["phases"]]
    assert sum(sent) == len(SCHED.arrivals(seed=0)) and sum(sent[::2]) > sum(sent[1::2])
    assert all(p["num_ok"] == p["num_sent"] for p in live["phases"])  # nothing refused
    assert all(p["ttft_p50_ms"] > 0 for p in live["phases"] if p["num_sent"])
    assert report["runs"]["tidal"]["simulated"]["all_lines_done"]
    assert png.read_bytes()[:4] == b"\x89PNG"
