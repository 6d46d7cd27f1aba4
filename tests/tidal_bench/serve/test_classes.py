"""`tidal bench classes`' simulated half and its table, without a stack (the live half is
exercised by tests/e2e/test_classes.py)."""

from __future__ import annotations

import argparse

from tidal.config.cluster import load_config
from tidal_bench.serve.classes import DEFAULT_STEP, arrivals, report, report_sim, run_sim


def test_arrivals_are_poisson_per_class_in_time_order_and_repeatable() -> None:
    load = arrivals({"interactive": 2.0, "standard": 10.0}, 20.0, seed=1)
    assert load == arrivals({"interactive": 2.0, "standard": 10.0}, 20.0, seed=1)
    assert [a.at_s for a in load] == sorted(a.at_s for a in load)
    n = {c: sum(a.class_name == c for a in load) for c in ("interactive", "standard")}
    assert 20 <= n["interactive"] <= 60 and 140 <= n["standard"] <= 260  # 40 and 200 expected
    assert len({a.req_id for a in load}) == len(load)


def test_the_simulated_overload_demotes_standard_and_completes_the_batch() -> None:
    cfg = load_config("classes.yaml")
    args = argparse.Namespace(prompt_tokens=200, max_tokens=64, batch_lines=10, duration_s=5.0,
                              batch_timeout_s=60.0, sim_step_model=DEFAULT_STEP)  # fmt: skip
    load = arrivals({"interactive": 1.0, "standard": 8.0}, 5.0, seed=0)
    sim = run_sim(args, cfg, load)
    rows = {r["name"]: r for r in sim["rows"]}
    asked = sum(a.class_name == "standard" for a in load)
    assert rows["standard"]["num_asked"] == asked
    assert rows["standard"]["num_demoted"] > 0 and rows["standard"]["num_rejected"] == 0
    # standard's bound is 4 in flight: what it did not run, batch ran
    assert rows["standard"]["num_served"] + rows["batch"]["num_served"] == asked
    assert rows["interactive"]["attainment"] == 1.0
    assert sim["batch"] == {"completed": 10, "lines": 10}
    live = {
        "counts": {"asked": {"standard": asked}, "served_in": {}, "demoted": {},
                   "rejected": {"standard": 0}},
        "attained": {"standard": (3, 1)},
        "batch": {"completed": 10, "lines": 10, "status": "completed", "failed": 0},
    }  # fmt: skip
    table = report(cfg, live, sim)
    std = next(line for line in table if line.startswith("standard"))
    assert f"{asked} / {asked}" in std and "75.0% of 4 / " in std
    assert table[-1].startswith("Batch API lines (batch): live 10 of 10 completed")


def test_sim_only_on_a_small_pool_the_interactive_class_evicts_standard() -> None:
    """`--sim-only --config classes-preempt.yaml`: standard work fills the 2048-token pools;
    interactive requests take their room by evicting it and all meet their SLO."""
    cfg = load_config("classes-preempt.yaml")
    args = argparse.Namespace(prompt_tokens=200, max_tokens=64, batch_lines=40, duration_s=20.0,
                              batch_timeout_s=120.0, sim_step_model=DEFAULT_STEP,
                              kv_capacity_tokens=0)  # fmt: skip
    load = arrivals({"interactive": 2.0, "standard": 8.0}, 20.0, seed=0)
    sim = run_sim(args, cfg, load)
    rows = {r["name"]: r for r in sim["rows"]}
    assert sim["num_class_evictions"] > 0
    assert rows["standard"]["num_preemptions"] >= sim["num_class_evictions"]
    assert rows["interactive"]["num_preemptions"] == 0
    assert rows["interactive"]["attainment"] == 1.0
    assert rows["interactive"]["num_served"] == rows["interactive"]["num_asked"]
    table = report_sim(cfg, sim)
    assert table[0].split() == ["class", "|", "asked", "|", "served", "|", "attained", "|",
                                "demoted", "|", "rejected", "|", "evicted"]  # fmt: skip
    assert table[-1] == f"evictions of an SLO class by a higher one: {sim['num_class_evictions']}"
