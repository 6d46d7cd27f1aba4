"""`tidal bench replay`: the calibration probe's fits, the step-trace summary, medians over
repeats and the defaults (full-size KV, both traces), without a live stack."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from tidal.config.cluster import load_config
from tidal.schemas.enums import RequestClass
from tidal.workload.mix import SimRequest
from tidal_bench.replay import probe
from tidal_bench.replay import run as replay_run


def _cfg():  # type: ignore[no-untyped-def]
    cfg = load_config("configs/ooco.yaml")
    return dataclasses.replace(cfg, cpu_workers=dataclasses.replace(cfg.cpu_workers, count=0))


def test_fit_line_recovers_a_line_and_stays_physical() -> None:
    # y = 0.03 + 2e-5 x
    assert probe.fit_line([100, 1000, 4000], [0.032, 0.05, 0.11]) == pytest.approx((0.03, 2e-5))
    assert probe.fit_line([100, 100], [0.01, 0.03]) == (pytest.approx(0.02), 0.0)  # one length
    assert probe.fit_line([100, 1000], [0.05, 0.02]) == (pytest.approx(0.035), 0.0)  # falls
    icpt, slope = probe.fit_line([1000, 2000], [0.0, 0.01])  # would cross below 0
    assert icpt == 0.0 and slope == pytest.approx(0.01 * 2000 / (1000**2 + 2000**2))


def test_by_length_takes_each_lengths_median() -> None:
    assert probe.by_length([5, 1, 5, 5], [1.0, 7.0, 9.0, 2.0]) == ([1.0, 5.0], [7.0, 2.0])


def test_probe_lengths_are_online_percentiles_repeated() -> None:
    on, off = RequestClass.ONLINE, RequestClass.OFFLINE
    reqs = [SimRequest(f"r{i}", on, i, 10 * (i + 1), 5) for i in range(100)]
    reqs.append(SimRequest("off", off, 0.0, 99999, 5))
    got = probe.probe_lengths(reqs)
    assert max(got) < 99999 and len(got) == probe.PROBE_REPEATS * len(set(got))
    with pytest.raises(ValueError, match="no online"):
        probe.probe_lengths([reqs[-1]])


def test_calibrate_recovers_the_serving_path_the_simulator_lacks() -> None:
    cfg = _cfg()
    sent = [probe.Lone(n, 2.0 * i, 0.0, 0.0) for i, n in enumerate([100, 100, 2000, 2000, 4000])]
    sim = probe.simulated_lone(cfg, "ooco", sent)
    # live = simulated + 30 ms + 10 us/token before the first token, + 50 ms to hand off
    live = [
        dataclasses.replace(
            s, ttft_s=s.ttft_s + 0.03 + 1e-5 * s.input_tokens, decode_s=s.decode_s + 0.05
        )
        for s in sim
    ]
    cal = probe.calibrate(cfg, "ooco", live)
    assert cal["dispatch_ms"] == pytest.approx(30.0, abs=1e-6)
    assert cal["dispatch_us_per_token"] == pytest.approx(10.0, abs=1e-6)
    assert cal["link_latency_ms"] == pytest.approx(cfg.link_latency_ms + 50.0, abs=1e-6)
    assert cal["link_gb_per_s"] == pytest.approx(cfg.link_gb_per_s)
    again = probe.simulated_lone(probe.with_calibration(cfg, cal), "ooco", sent)
    for a, b in zip(live, again, strict=True):  # the calibrated simulator reproduces the probe
        assert b.ttft_s == pytest.approx(a.ttft_s, abs=1e-6)
        assert b.decode_s == pytest.approx(a.decode_s, abs=2e-3)


def test_calibrate_refuses_an_empty_probe() -> None:
    with pytest.raises(ValueError, match="no probe request"):
        probe.calibrate(_cfg(), "ooco", [])


def test_step_summary_reads_each_instances_trace(tmp_path: Path) -> None:
    rows = [
        {"emulated_s": 0.01, "wall_s": 0.011, "host_s": 0.002, "late_s": 0.001},
        {"emulated_s": 0.01, "wall_s": 0.013, "host_s": 0.004, "late_s": 0.003},
    ]
    (tmp_path / "instance-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "instance-0.jsonl").write_text("")
    got = probe.step_summary(tmp_path)
    assert list(got) == ["instance-1"]
    s = got["instance-1"]
    assert s["num_steps"] == 2
    assert s["overrun_ms_p50_p90_p99"][0] == pytest.approx(2.0)
    assert s["overrun_total_pct"] == pytest.approx(100 * 0.004 / 0.02)


def test_median_run_takes_medians_per_side() -> None:
    def run(x: float) -> dict:  # type: ignore[type-arg]
        side = {key: x for key, _, _ in replay_run.KEYS}
        return {s: dict(side) for s in replay_run.SIDES} | {"calibration": {"dispatch_ms": x}}

    med = replay_run.median_run([run(1.0), run(5.0), run(2.0)])
    assert med["live"]["ttft_p50_s"] == 2.0 and med["simulator"]["offline_tokens_per_s"] == 2.0
    assert len(med["repeats"]) == 3 and med["calibrations"][1] == {"dispatch_ms": 5.0}


def test_defaults_ship_full_kv_and_replay_both_traces() -> None:
    parser = argparse.ArgumentParser()
    replay_run.register(parser.add_subparsers())
    args = parser.parse_args(["replay"])
    assert args.kv_payload_bytes_per_token == -1
    assert args.config == ["configs/ooco.yaml", "configs/ooco-long.yaml"]
    assert args.policies == ["tidal", "ooco", "online-priority"]
    res = replay_run._resources(_cfg(), "ooco", args.kv_payload_bytes_per_token)
    assert res["cpu_attention_workers"] == 0 and len(res["instances"]) == 2


def test_bad_repeats_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    replay_run.register(parser.add_subparsers())
    args = parser.parse_args(["replay", "--repeats", "0"])
    assert args.func(args) == 2
    assert "--repeats" in capsys.readouterr().err


def test_plot_writes_one_panel_per_config(tmp_path: Path) -> None:
    from tidal_bench.replay import plot

    def side(x: float) -> dict[str, float]:
        return {key: x for key, _, _ in replay_run.KEYS}

    run = {
        "live": side(1.0),
        "simulator": side(1.05),
        "simulator_probe": side(0.9),
        "simulator_uncalibrated": side(0.5),
    }
    assert plot.errors(run, "simulator")[0] == pytest.approx(0.05)  # points
    assert plot.errors(run, "simulator")[1] == pytest.approx(5.0)  # %
    rep = {"config": "configs/ooco.yaml", "duration_s": 30.0, "runs": {"ooco": run, "tidal": run}}
    path = tmp_path / "rep.json"
    path.write_text(json.dumps(rep))
    out = tmp_path / "f.png"
    assert plot.main([str(path), str(path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = plot.markdown(rep).splitlines()
    assert len(table) == 2 + len(replay_run.KEYS)
    assert "1.000 / 1.050 / **+5.0 %** (-10.0 %; -50.0 %)" in table[3]  # TTFT p50 row


def test_serving_path_matches_client_and_engine_clocks(tmp_path: Path) -> None:
    events = [
        {"event": "add", "req_id": "a", "unix_s": 100.030},
        {"emulated_s": 0.01, "wall_s": 0.01, "host_s": 0.0, "late_s": 0.0},
        {"event": "first", "req_id": "a", "unix_s": 100.050},
    ]
    (tmp_path / "instance-0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "instance-1.jsonl").write_text(
        json.dumps({"event": "first", "req_id": "a", "unix_s": 100.2}) + "\n"  # later: ignored
    )
    ev = probe.request_events(tmp_path)
    assert ev == {"a": {"add": 100.030, "first": 100.050}}
    reqs = [
        {
            "class": "online",
            "req_id": "cmpl-a",
            "sent_unix_s": 100.0,
            "first_token_unix_s": 100.058,
        },
        {"class": "offline", "req_id": "b", "sent_unix_s": 100.0, "first_token_unix_s": 101.0},
    ]
    path = probe.serving_path(reqs, ev)
    assert path["num_matched"] == 1
    assert path["in_ms_p50_p90_p99"] == [pytest.approx(30.0)] * 3
    assert path["out_ms_p50_p90_p99"] == [pytest.approx(8.0)] * 3
    assert probe.step_summary(tmp_path)["instance-0"]["num_steps"] == 1
