"""`tidal bench colocation --search-offline`: the simulator's side counted as the live side is,
bad input refused, reports merged, and one tiny search on a real stack (sim engine)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from services.cli.main import main
from tidal_bench.colocation import search as cs
from tidal_bench.colocation import sim_side
from tidal_bench.colocation.report import merged, table

TINY = [
    "bench",
    "colocation",
    "--engine",
    "sim",
    "--search-offline",
    "--policies",
    "ooco",
    "--cpu-attn",
    "0",
    "--warmup-s",
    "2",
    "--measure-s",
    "4",
    "--repeats",
    "1",
    "--iters",
    "0",
    "--start-qps",
    "1",
    "--max-qps",
    "1",
    "--set",
    "offline.max_output_tokens=16",
]


def _args(**kw: object) -> argparse.Namespace:
    base = dict(config="configs/ooco.yaml", set=[], warmup_s=2.0, measure_s=4.0)
    return argparse.Namespace(**{**base, **kw})


def test_the_config_after_set_is_what_both_sides_run(tmp_path: Path) -> None:
    cfg, path = cs.write_config(
        _args(set=["online.start_s=60", "offline.max_output_tokens=16"]), str(tmp_path)
    )
    assert cfg.duration_s == 6.0  # warm-up + measured
    assert cfg.online is not None and cfg.online.start_s == 60
    assert "max_output_tokens: 16" in Path(path).read_text()  # the stack reads the same
    online, offline = cs.streams(cfg, 2.0)
    again, none = cs.streams(cfg, 0.0)
    assert online == again and online  # the online window does not move with the offline load
    assert none == [] and len(offline) == 12  # 2 lines/s, uniform, over 6 s
    assert all(r.output_tokens <= 16 for r in offline)


def test_a_simulated_window_counts_only_after_the_warm_up(tmp_path: Path) -> None:
    cfg, _ = cs.write_config(_args(set=["offline.max_output_tokens=16"]), str(tmp_path))
    alone = sim_side.sim_window(cfg, "ooco", 0.0, 2.0)
    busy = sim_side.sim_window(cfg, "ooco", 2.0, 2.0)
    assert alone.offline_tokens_per_s == 0.0 and alone.num_online == busy.num_online > 0
    # 16-token lines finish in well under a second of emulated time: about 2 lines/s complete
    assert 1.0 <= busy.offline_lines_per_s <= 3.0
    assert busy.offline_tokens_per_s <= 16 * busy.offline_lines_per_s


def test_a_simulated_window_keeps_the_batch_lines_in_flight_and_counts_tokens_as_made(
    tmp_path: Path,
) -> None:
    cfg, _ = cs.write_config(_args(set=["offline.max_output_tokens=256"]), str(tmp_path))
    assert sim_side.window_bin_s(2.0, 6.0) == 2.0 and sim_side.window_bin_s(4.0, 14.5) == 0.5
    free = sim_side.sim_window(cfg, "ooco", 16.0, 2.0)
    capped = sim_side.sim_window(dataclasses.replace(cfg, batch_max_inflight=2), "ooco", 16.0, 2.0)
    assert capped.num_online == free.num_online > 0
    assert 0 < capped.tpot_p99_s < 0.05 and 0 < capped.ttft_p99_s < 2.0  # beside the live p99s
    # two lines at a time cannot keep up with 16 lines/s of up to 256 tokens each
    assert 0 < capped.offline_tokens_per_s < free.offline_tokens_per_s
    assert capped.offline_lines_per_s < free.offline_lines_per_s
    # tokens count as they are made, so lines still running at the end count too (the live
    # `tidal_batch_generated_tokens_total`); a line's tokens are never more than its 256
    assert capped.offline_tokens_per_s <= 256 * (capped.offline_lines_per_s + 2 / 4.0)


def test_bad_input_is_refused_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "r.json")
    assert main([*TINY, "--repeats", "0", "--json", out]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert main([*TINY, "--set", "online.no_such_key=1", "--json", out]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert main([*TINY, "--batch-max-inflight", "0", "--json", out]) == 2
    assert "--batch-max-inflight" in capsys.readouterr().err
    assert main([*TINY, "--engine-cores", "0", "--cpu-attn-cores", "0", "--json", out]) == 2
    assert "--cpu-attn-cores" in capsys.readouterr().err  # the engine's and workers' overlap
    assert not Path(out).exists()


def test_every_policy_stack_gets_the_same_core_pinning(tmp_path: Path) -> None:
    args = _args(
        engine="torch",
        policies=["ooco", "tidal"],
        without_cpu_attn=["tidal"],
        cpu_attn=1,
        batch_max_inflight=32,
        engine_cores="0",
        cpu_attn_cores="1",
        service_cores="1",
    )
    cfg, path = cs.write_config(args, str(tmp_path))
    stacks = []
    for name, policy, workers in cs.variants(args):
        res = cs.resources(args, cfg, policy, workers)
        up = cs.up_args(args, path, policy, res)
        stacks.append((name, res["cpu_attn_workers"], up[up.index("--engine-cores") :]))
    assert [(n, w) for n, w, _ in stacks] == [("ooco", 1), ("tidal", 1), ("tidal/no-cpu-attn", 0)]
    pins = ["--engine-cores", "0", "--cpu-attn-cores", "1", "--service-cores", "1"]
    assert all(u == pins for _, _, u in stacks)  # the worker-less stack keeps the engine's core
    text = table(
        {
            "engine": "torch",
            "config": "c",
            "window": "w",
            "violation": 3.0,
            "repeats": 3,
            "policies": {"ooco": {**_entry(1.0), "resources": res}},
        }
    )
    assert "pinned: engine 0, cpu_attn 1, service 1" in text


def _entry(tok: float) -> dict:
    res = {
        "instances": [{"role": "relaxed", "chunk_size": 2048, "count": 1}],
        "kv_cache_tokens_per_instance": 1024,
        "cpu_attn_workers": 1,
        "cpu_attn_workers_usable": 1,
        "batch_max_inflight": 32,
        "host_cores": 2,
    }
    return {
        "max_offline_tokens_per_s": tok,
        "max_offline_qps": 1.0,
        "attainment": 98.0,
        "spread": {"attainment_pct": [97.0, 99.0], "offline_tokens_per_s": [tok - 1, tok + 1]},
        "saturated": False,
        "sim_max_offline_tokens_per_s": 2 * tok,
        "resources": res,
        "probes": [],
    }


def test_a_split_search_merges_only_into_a_report_of_the_same_settings() -> None:
    head = {"engine": "torch", "config": "c", "window": "w", "violation": 3.0, "repeats": 3}
    a = {**head, "wall_s": 10.0, "policies": {"ooco": _entry(10.0)}}
    b = {**head, "wall_s": 5.0, "policies": {"tidal": _entry(20.0)}}
    m = merged(a, b)
    assert list(m["policies"]) == ["ooco", "tidal"] and m["wall_s"] == 15.0
    with pytest.raises(ValueError, match="window"):
        merged(a, {**b, "window": "other"})
    # an earlier report records its lines in flight in its policies' resources only (32 here)
    assert list(merged(a, {**b, "batch_max_inflight": 32})["policies"]) == ["ooco", "tidal"]
    with pytest.raises(ValueError, match="batch_max_inflight"):
        merged(a, {**b, "batch_max_inflight": 128})
    text = table({**m, "sim_step_model": None})
    assert "ooco" in text and "tidal" in text and "KV 1024 tokens/instance" in text
    assert "1 CPU-attn worker(s) (1 usable" in text


@pytest.mark.e2e
@pytest.mark.nats
@pytest.mark.slow
def test_a_tiny_search_on_the_sim_engine_reports_live_and_simulated_figures(
    tmp_path: Path,
) -> None:
    out = tmp_path / "colo.json"
    assert main([*TINY, "--batch-max-inflight", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["emulated"] is True and report["engine"] == "sim"
    e = report["policies"]["ooco"]
    assert [p["offline_qps"] for p in e["probes"]] == [0.0, 1.0]
    alone, busy = e["probes"]
    assert alone["offline_tokens_per_s"] == 0.0
    assert busy["offline_tokens_per_s"] > 0  # lines went through /v1/files + /v1/batches
    assert 0.0 <= e["attainment"] <= 100.0
    assert e["sim_max_offline_tokens_per_s"] > 0
    assert e["resources"]["cpu_attn_workers"] == 0
    assert e["resources"]["kv_cache_tokens_per_instance"] > 0
    assert e["resources"]["batch_max_inflight"] == 8  # the stack's batch service ran with it
    assert Path(report["plot"]).exists()


def test_figures_are_reported_as_shares_of_the_limit_with_what_ended_each_search(
    tmp_path: Path,
) -> None:
    args = _args(
        set=["offline.max_output_tokens=256"], engine="sim", violation=3.0, engine_cores="0"
    )
    cfg, _ = cs.write_config(args, str(tmp_path))
    args.sim_step_model = cfg.step_model_spec()
    e = {**_entry(1000.0), "bound_text": "SLO-bound at 12 (fails at 16)"}
    e["simulator"] = {"bound_text": "saturated at 16"}
    e.update(cs.shares(args, cfg, "tidal", 0, e))
    lim = e["limit"]
    assert lim["label"] == "simulated" and lim["tokens_per_s"] > 2000.0
    assert e["share_of_limit"] == pytest.approx(1000.0 / lim["tokens_per_s"])
    assert e["sim_share_of_limit"] == pytest.approx(2000.0 / lim["tokens_per_s"])
    head = {"engine": "sim", "sim_step_model": args.sim_step_model, "config": "c", "window": "w"}
    text = table({**head, "violation": 3.0, "repeats": 3, "policies": {"tidal": e}})
    assert "live SLO-bound at 12 (fails at 16) lines/s, simulator saturated at 16" in text
    assert "live / simulator 0.50" in text and "same step model on both sides" in text
    # which of the limit's two step floors binds, and the steps the SLO pace forces
    what = {"kv": "KV residency", "pacing": "the SLO pace"}[lim["binding"]]
    assert f"the limit bound by {what} ({lim['paced_steps']} paced steps" in text
    assert lim["paced_steps"] > 0 and lim["paced_gpu_s"] > 0
    # a config whose limit cannot be computed has none, and says why
    off = dataclasses.replace(cfg, latency_model="regression")
    assert "regression" in cs.shares(args, off, "tidal", 0, e)["limit"]["error"]


def test_torch_engines_pinned_to_one_core_share_one_cores_limit(tmp_path: Path) -> None:
    # tidal's two instances on core 0: the live figure and the simulator's (whose instances
    # share that core too) are shares of the limit on one device
    args = _args(
        set=["offline.max_output_tokens=256"], engine="torch", violation=3.0, engine_cores="0"
    )
    cfg, _ = cs.write_config(args, str(tmp_path))
    args.sim_step_model = cfg.step_model_spec()
    assert sum(g.count for g in cfg.groups_for("tidal")) == 2
    e = {**_entry(1000.0), "sim_max_offline_tokens_per_s": 2000.0}
    e.update(cs.shares(args, cfg, "tidal", 0, e))
    lim = e["limit"]
    own = cs.shares(
        argparse.Namespace(**{**vars(args), "engine_cores": "0-1"}), cfg, "tidal", 0, e
    )["limit"]
    assert lim["gpu_s"] == pytest.approx(own["gpu_s"] / 2) == pytest.approx(cfg.duration_s)
    assert lim["tokens_per_s"] < own["tokens_per_s"] / 2  # the online load takes its part first
    assert lim["devices"] == "2 instances on 1 core(s) (engine cores 0), live and simulated"
    assert e["share_of_limit"] == pytest.approx(1000.0 / lim["tokens_per_s"])
    assert e["sim_share_of_limit"] == pytest.approx(2000.0 / lim["tokens_per_s"])
    assert "sim_limit" not in e
    e |= {"bound_text": "SLO-bound at 2 (fails at 4)", "simulator": {"bound_text": "saturated"}}
    head = {"engine": "torch", "sim_step_model": args.sim_step_model, "config": "c", "window": "w"}
    text = table({**head, "violation": 3.0, "repeats": 2, "policies": {"tidal": e}})
    assert f"limit {lim['tokens_per_s']:.0f} tok/s on 2 instances on 1 core(s)" in text
    # on both cores (or unpinned on this 2-core host) each instance has one
    assert own["devices"] == "one device an instance"


def test_the_simulator_shares_the_cores_the_live_engines_share(tmp_path: Path) -> None:
    args = _args(set=["offline.max_output_tokens=16"], engine="torch", engine_cores="0")
    cfg, _ = cs.write_config(args, str(tmp_path))
    assert cfg.num_devices is None  # the stack's config is not changed
    shared = sim_side.sim_config(args, cfg, "ooco")
    assert shared.num_devices == 1 and shared.instances == cfg.instances
    both = argparse.Namespace(**{**vars(args), "engine_cores": "0-1"})
    assert sim_side.sim_config(both, cfg, "ooco") is cfg  # a core each: nothing shared
    # the sim engine emulates each instance's steps on its own
    assert (
        sim_side.sim_config(argparse.Namespace(**{**vars(args), "engine": "sim"}), cfg, "ooco")
        is cfg
    )
    set_own = dataclasses.replace(cfg, num_devices=2)
    assert sim_side.sim_config(args, set_own, "ooco") is set_own  # the config's own stands
    own = sim_side.sim_window(cfg, "ooco", 8.0, 2.0)
    one = sim_side.sim_window(shared, "ooco", 8.0, 2.0)
    assert one.num_online == own.num_online > 0
    assert one.tpot_p99_s > own.tpot_p99_s  # every step slower while both step


def test_the_shared_cores_take_the_slowdown_stored_with_the_step_profile(tmp_path: Path) -> None:
    args = _args(set=["offline.max_output_tokens=16"], engine="torch", engine_cores="0")
    cfg, _ = cs.write_config(args, str(tmp_path))
    assert sim_side.sim_config(args, cfg, "ooco").shared_device_slowdown == 1.0  # no profile
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"format": "tidal-perf-profile/1"}))
    with_prof = dataclasses.replace(cfg, profile=str(prof))
    assert sim_side.sim_config(args, with_prof, "ooco").shared_device_slowdown == 1.0  # none there
    prof.write_text(
        json.dumps({"format": "tidal-perf-profile/1", "shared_device_slowdown": {"factor": 1.07}})
    )
    shared = sim_side.sim_config(args, with_prof, "ooco")
    assert shared.num_devices == 1 and shared.shared_device_slowdown == 1.07
    own = dataclasses.replace(with_prof, shared_device_slowdown=1.2)
    assert sim_side.sim_config(args, own, "ooco").shared_device_slowdown == 1.2  # the config's
    both = argparse.Namespace(**{**vars(args), "engine_cores": "0-1"})
    assert sim_side.sim_config(both, with_prof, "ooco") is with_prof  # a core each: no slowdown
    prof.write_text(
        json.dumps({"format": "tidal-perf-profile/1", "shared_device_slowdown": {"factor": 0.9}})
    )
    with pytest.raises(ValueError, match="factor must be >= 1"):
        sim_side.sim_config(args, with_prof, "ooco")
    # the torch co-location runs' profile carries the factor measured on this project's host
    measured = sim_side.profile_slowdown(
        "docs/results/colocation/torch_steps_profile_batch128.json"
    )
    report = json.loads(Path("docs/results/colocation/shared_core_contention.json").read_text())
    assert measured == report["c_all_kinds_median"] > 1.0


def test_a_points_cpu_is_the_median_of_its_windows() -> None:
    from tidal_bench.colocation.live_window import cpu_row
    from tidal_bench.colocation.max_offline import Measurement, Point

    def m(gw: float, busy: float) -> Measurement:
        read = {"window_s": 10.0, "cpu_s": {"gateway-0": 10 * gw, "batch-0": 2.0},
                "core_busy": {0: busy, 1: 0.5}}  # fmt: skip
        return Measurement(100.0, 1.0, 1.0, cpu=cpu_row(read))

    p = Point(4.0, (m(0.2, 0.9), m(0.4, 1.0), m(0.3, 0.8)))
    cpu = cs.point_cpu(p)
    assert cpu is not None
    assert cpu["cpu_s_per_s"] == {"batch-0": 0.2, "gateway-0": 0.3}
    assert cpu["stack_and_loadgen_cpu_s_per_s"] == pytest.approx(0.5)
    assert cpu["core_busy"] == {"0": 0.9, "1": 0.5}
    assert cs.point_cpu(Point(1.0, (Measurement(100.0, 1.0, 1.0),))) is None


def test_the_simulator_is_run_at_every_load_the_live_search_probed(tmp_path: Path) -> None:
    from tidal_bench.colocation.max_offline import Measurement, Outcome, Point

    args = _args(set=["offline.max_output_tokens=16"], batch_max_inflight=64)
    cfg, _ = cs.write_config(args, str(tmp_path))
    live = [
        Point(0.0, (Measurement(100.0, 0.0, 0.0),)),
        Point(2.0, (Measurement(100.0, 20.0, 2.0),)),
    ]
    rows = sim_side.at_loads(cfg, "ooco", args, 0, Outcome(live[1], live))
    assert [r["offline_qps"] for r in rows] == [2.0]  # not the zero-load point
    (row,) = rows
    sim = sim_side.sim_window(dataclasses.replace(cfg, batch_max_inflight=64), "ooco", 2.0, 2.0)
    assert row["sim_offline_tokens_per_s"] == sim.offline_tokens_per_s > 0
    assert row["live_over_sim"] == pytest.approx(20.0 / sim.offline_tokens_per_s)
