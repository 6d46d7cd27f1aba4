"""`tidal bench burst`'s report, table and plot, and the command on the simulator alone (the
live side on a tiny embedded stack is in test_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.main import main
from tidal_bench.burst.report import markdown, plot, print_policy, side_report
from tidal_bench.burst.schedule import BurstSchedule, OnlineResult, jobs_from_times

SCHED = BurstSchedule(
    high_rate=2.0,
    low_rate=0.5,
    phase_s=10.0,
    cycles=1,
    prompt_tokens=32,
    output_tokens=8,
    jobs=2,
    lines=2,
    line_prompt_tokens=64,
    line_output_tokens=16,
)


def make_raw(done: dict[str, float]) -> dict[str, object]:
    online = [OnlineResult(1.0, "ok", 0.05, 0.01), OnlineResult(12.0, "429")]
    return {"online": online, "jobs": jobs_from_times(SCHED, 0.0, done)}


def test_a_side_with_every_line_done_says_so_and_a_missing_line_is_counted_lost() -> None:
    full = side_report(
        SCHED, "live", make_raw({"job0-0": 1, "job0-1": 2, "job1-0": 3, "job1-1": 4.5})
    )
    assert full["all_lines_done"] and full["num_lines_lost"] == 0
    assert full["last_job_completed_s"] == 4.5
    assert "emulated" in full["label"]
    assert [p["num_sent"] for p in full["phases"]] == [1, 1]
    short = side_report(SCHED, "simulated", make_raw({"job0-0": 1, "job0-1": 2, "job1-0": 3}))
    assert not short["all_lines_done"] and short["num_lines_lost"] == 1
    assert short["last_job_completed_s"] is None
    assert "simulated" in short["label"]


def test_the_table_names_each_phase_side_and_job(capsys: pytest.CaptureFixture[str]) -> None:
    done = {"job0-0": 1, "job0-1": 2, "job1-0": 3, "job1-1": 4.5}
    sides = {s: side_report(SCHED, s, make_raw(done)) for s in ("live", "simulated")}
    print_policy("tidal", sides)
    out = capsys.readouterr().out
    assert "0 burst" in out and "1 trough" in out
    assert out.count("live ") == 3 and out.count("simulated ") == 3  # 2 phases + the jobs
    assert "job 1: 2/2 lines, done at 4.5 s" in out
    md = markdown({"runs": {"tidal": sides}})
    assert md.count("| tidal | live |") == 2 and "| 2 / 4 |" in md  # jobs done at 2 s, 4.5 s


def test_the_plot_is_written(tmp_path: Path) -> None:
    done = {"job0-0": 1, "job0-1": 2, "job1-0": 3, "job1-1": 4.5}
    sides = {s: side_report(SCHED, s, make_raw(done)) for s in ("live", "simulated")}
    out = tmp_path / "burst.png"
    plot({"runs": {"ooco": sides, "tidal": sides}}, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_simulated_side_completes_every_line_and_reports_each_phase(tmp_path: Path) -> None:
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "burst", "--sides", "simulated", "--policies", "online-priority", "tidal"]
    argv += ["--phase-s", "5", "--cycles", "2", "--jobs", "2", "--lines", "20"]
    argv += ["--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert list(report["runs"]) == ["online-priority", "tidal"]
    for sides in report["runs"].values():
        sim = sides["simulated"]
        assert sim["all_lines_done"] and sim["num_lines_lost"] == 0
        assert [p["kind"] for p in sim["phases"]] == ["burst", "trough"] * 2
        assert sum(p["num_sent"] for p in sim["phases"]) > 0
        assert all(p["ttft_p99_ms"] > 0 for p in sim["phases"] if p["num_ok"])
        for job in sim["jobs"]:
            assert job["curve"][-1][1] == 20 and job["completed_s"] == job["curve"][-1][0]
    assert png.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--low-rate", "9"], "swap --high-rate and --low-rate"),
        (["--sides", "both"], "--sides takes live and/or simulated"),
        (["--url", "http://x/v1"], "--url measures one running stack"),
        (["--job-timeout-s", "0"], "--job-timeout-s must be > 0"),
        (["--client", "guidellm", "--guidellm", "/nonexistent/guidellm"], "guidellm not found"),
    ],
)
def test_bad_input_is_refused_with_a_message(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "burst", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_late_online_start_moves_the_simulators_arrivals_not_their_phases() -> None:
    from tidal.config.cluster import load_config
    from tidal_bench.burst.simulated import run_simulated

    cfg = load_config("configs/ooco.yaml")
    sched = BurstSchedule(
        high_rate=4.0,
        low_rate=1.0,
        phase_s=5.0,
        cycles=2,
        prompt_tokens=64,
        output_tokens=8,
        jobs=1,
        lines=4,
        line_prompt_tokens=64,
        line_output_tokens=8,
    )
    on_time = run_simulated(cfg, "tidal", sched, 0, 60.0)
    late = run_simulated(cfg, "tidal", sched, 0, 60.0, online_offset_s=7.0)
    assert late["online_offset_s"] == 7.0
    assert sorted(r.sent_s for r in late["online"]) == pytest.approx(
        sorted(r.sent_s for r in on_time["online"])
    )  # on the schedule's clock either way
    assert all(r.outcome == "ok" for r in late["online"])
    assert late["jobs"][0]["num_results"] == 4
