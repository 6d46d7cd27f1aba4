"""`tidal.perf.spec`: the text a live sim-engine instance is given emulates the same model the
simulator builds from the config (tp, latency model and profile included)."""

from __future__ import annotations

import pytest

from tidal.config.cluster import load_config
from tidal.configs import config_path
from tidal.perf import make_step_model, model_spec
from tidal.perf.api import BatchShape
from tidal.perf.spec import StepModelSpec, parse_spec
from tidal.sim.build import instance_setups, kv_geometry

SHAPES = [
    BatchShape(num_decode_reqs=1, decode_context_tokens=100),
    BatchShape(num_prefill_tokens=2048, num_decode_reqs=32, decode_context_tokens=40_000),
]


def test_text_round_trips_and_a_plain_pair_keeps_its_meaning() -> None:
    spec = StepModelSpec("yi-34b", "a100-80gb", tp=2, kind="roofline", profile=None)
    assert str(spec) == "yi-34b@a100-80gb,tp=2" and parse_spec(str(spec)) == spec
    assert parse_spec("llama-2-7b@a100-80gb") == StepModelSpec("llama-2-7b", "a100-80gb")
    full = "llama-2-7b@a100-40gb,tp=4,kind=regression,profile=p.json"
    assert str(parse_spec(full)) == full


@pytest.mark.parametrize(
    "bad",
    [
        "llama-2-7b",
        "@a100-80gb",
        "nope@a100-80gb",
        "llama-2-7b@nope",
        "llama-2-7b@a100-80gb,tp=0",
        "llama-2-7b@a100-80gb,tp=two",
        "llama-2-7b@a100-80gb,kind=magic",
        "llama-2-7b@a100-80gb,speed=9",
        "llama-2-7b@a100-80gb,tp=2,tp=2",
    ],
)
def test_bad_text_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="step model"):
        parse_spec(bad)


@pytest.mark.parametrize("name", ["omniserve.yaml", "ooco.yaml", "hygen.yaml"])
def test_a_configs_spec_emulates_what_the_simulator_builds(name: str) -> None:
    # omniserve.yaml is Yi-34B on 2 GPUs: the live side used to emulate 1 (tp was dropped)
    cfg = load_config(config_path(name))
    spec = parse_spec(cfg.step_model_spec())
    assert spec.tp == cfg.tp and spec.model == cfg.model and spec.hardware == cfg.hardware
    live, sim = spec.build(), instance_setups(cfg, "tidal")[0].step_model
    assert [live.step_s(s) for s in SHAPES] == [sim.step_s(s) for s in SHAPES]
    kvb, layers, tokens = spec.kv_geometry(cfg.mem_fraction)
    assert layers == model_spec(cfg.model).num_layers
    sim_kvb, sim_blocks = kv_geometry(cfg)
    assert kvb == sim_kvb and tokens // cfg.block_size == sim_blocks


def test_tp_changes_the_emulated_model() -> None:
    one = make_step_model("yi-34b", "a100-80gb")
    two = parse_spec("yi-34b@a100-80gb,tp=2").build()
    assert two.step_s(SHAPES[1]) < one.step_s(SHAPES[1])
