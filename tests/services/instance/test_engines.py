from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from services.instance.engines import build_engine
from tidal.engine.sim.engine import SimEngine
from tidal.engine.sim.tokens import shipped_tokenizer_dir
from tidal.engine.tokenizer import load_tokenizer
from tidal.perf.api import BatchShape
from tidal.perf.linear import DEFAULT_SIM_STEP_MODEL, LinearStepModel
from tidal.perf.spec import parse_step_model


def test_step_model_specs() -> None:
    assert parse_step_model("zero").step_s(BatchShape(num_decode_reqs=8)) == 0.0
    assert parse_step_model("linear") == DEFAULT_SIM_STEP_MODEL
    custom = parse_step_model("linear:0.01,0.001,0.002,0.0001")
    assert custom == LinearStepModel(0.01, 0.001, 0.0001, 0.0, 0.002)
    # 0.01 + (100 + 2)*0.001 + 2*0.002 + 50*0.0001 = 0.121 s
    shape = BatchShape(num_prefill_tokens=100, num_decode_reqs=2, decode_context_tokens=50)
    assert custom.step_s(shape) == pytest.approx(0.121)
    perf_model = parse_step_model("llama-2-7b@a100-80gb")
    assert perf_model.step_s(BatchShape(num_decode_reqs=1, decode_context_tokens=100)) > 0


@pytest.mark.parametrize("bad", ["fast", "linear:1,2", "linear:a,b,c,d", "linear:-1,0,0,0"])
def test_bad_step_model_specs_are_clear_errors(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_step_model(bad)


def test_sim_engine_is_built_realtime_with_the_asked_tokenizer_and_pool() -> None:
    args = argparse.Namespace(
        engine="sim",
        model="",
        max_model_len=0,
        kv_cache_tokens=16384,
        tokenizer="bytes",
        sim_step_model="zero",
    )
    eng = build_engine(args)
    assert isinstance(eng, SimEngine)
    assert eng.config.realtime and eng.config.tokenizer == "bytes"
    assert eng.num_kv_blocks == 16384 // eng.block_size and eng.model_name == "tidal-sim"


def test_sim_engine_stands_in_for_a_model_directory_with_its_tokenizer(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    shutil.copytree(shipped_tokenizer_dir(), model)  # tokenizer.json + tokenizer_config.json
    args = argparse.Namespace(
        engine="sim", model=str(model), max_model_len=0, sim_step_model="zero"
    )
    eng = build_engine(args)
    assert eng.model_name == "tiny-llama"
    assert eng.tokenizer.encode("the tide") == load_tokenizer(model).encode("the tide")
    args.served_model_name = "served"
    assert build_engine(args).model_name == "served"


def test_a_sim_engine_emulating_a_7b_model_carries_its_kv_geometry() -> None:
    from services.instance.engines import build_engine, emulated_geometry
    from services.instance.main import parse_args

    geo = emulated_geometry("qwen2.5-7b@a100-80gb")
    # 28 layers * (k, v) * 4 KV heads * 128 dims * 2 bytes (bf16)
    assert geo["kv_bytes_per_token"] == 57_344 and geo["num_layers"] == 28
    # 0.9 * 80 GB less ~15 GB of weights, in blocks of 16 tokens: ~1M tokens of KV
    assert 900_000 < geo["num_kv_blocks"] * 16 < 1_200_000
    args = parse_args(
        ["--id", "i", "--sim-step-model", "qwen2.5-7b@a100-80gb", "--tokenizer", "bytes"]
    )
    engine = build_engine(args)
    assert engine.kv_bytes_per_token == 57_344
    assert emulated_geometry("linear") == {}
