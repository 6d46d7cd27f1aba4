"""The torch engine's dtype, chosen on CPU by measured matmul speed."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engine.torch import dtype_choice as dc
from tidal.engine.torch.model_config import ModelConfig

TINY = ModelConfig(
    model_type="llama",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


REAL_CORES = dc.cpu_meter.OthersMeter.cores  # before the fixture below replaces it


# the tests below count calibrations (`quiet_machine`: tests/tidal/engine/conftest.py)
pytestmark = pytest.mark.usefixtures("quiet_machine")


def test_decide_picks_the_faster_dtype_by_geometric_mean() -> None:
    fast_small = {"float32": {"1": 10.0, "8": 20.0}, "bfloat16": {"1": 5.0, "8": 30.0}}
    c = dc.decide(fast_small)  # ratios 0.5 and 1.5: geometric mean 0.87
    assert c.dtype == "bfloat16" and c.torch_dtype == torch.bfloat16
    assert "0.50 at batch 1" in c.reason and "1.50 at batch 8" in c.reason
    slow = {"float32": {"1": 10.0, "8": 20.0}, "bfloat16": {"1": 9.0, "8": 40.0}}
    assert dc.decide(slow).dtype == "float32"


def test_fp32_takes_bf16_weight_copies_for_the_rows_bf16_wins() -> None:
    # AVX2 as measured here: bf16 GEMVs win at 1 and 8 rows, GEMMs lose at 32 and 128
    avx2 = {
        "float32": {"1": 30.0, "8": 40.0, "32": 60.0, "128": 200.0},
        "bfloat16": {"1": 10.0, "8": 20.0, "32": 240.0, "128": 800.0},
    }  # ratios 0.33, 0.5, 4, 4: geometric mean 1.15
    c = dc.decide(avx2)
    assert c.dtype == "float32" and c.bf16_weight_rows == 8
    assert "with bf16 weight copies for matmuls of up to 8 rows" in c.reason
    # a near tie at 8 rows (0.9 >= SMALL_ROWS_RATIO) stops the split at 1
    tie = {**avx2, "bfloat16": {**avx2["bfloat16"], "8": 36.0}}
    assert dc.decide(tie).bf16_weight_rows == 1
    # the split is a prefix: no copies when the smallest row count is not clearly faster
    assert dc.small_rows({"1": 0.85, "8": 0.5, "32": 4.0}) == 0
    assert dc.small_rows({"1": 0.5, "8": 0.5, "32": 0.7, "128": 0.9}) == 32
    # a bf16 pick runs everything in bf16 (AVX-512 as measured: 0.26-0.31 everywhere)
    avx512 = {"float32": {"1": 30.0, "8": 40.0}, "bfloat16": {"1": 9.0, "8": 12.0}}
    assert dc.decide(avx512).dtype == "bfloat16" and dc.decide(avx512).bf16_weight_rows == 0


def test_the_split_is_cached_and_applied_by_the_loader(
    make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    table = {"float32": {"1": 3.0, "32": 6.0}, "bfloat16": {"1": 1.0, "32": 24.0}}
    monkeypatch.setattr(dc, "calibration_passes", lambda cfg, dt: {})
    monkeypatch.setattr(dc, "time_passes", lambda passes: table)
    engine = make_engine("llama", dtype=None)
    assert engine.dtype_choice is not None and engine.dtype_choice.bf16_weight_rows == 1
    small = engine.model.small
    assert engine.model.dtype == torch.float32 and small is not None and small.max_rows == 1
    monkeypatch.setattr(dc, "time_passes", lambda passes: pytest.fail("measured again"))
    cfg = engine.model.config
    again = dc.choose_dtype(cfg, torch.device("cpu"))
    assert again.bf16_weight_rows == 1 and again.reason.endswith("(cached)")


def test_time_passes_interleaves_dtypes_and_keeps_the_best_run() -> None:
    order: list[str] = []
    passes = {d: {b: (lambda d=d, b=b: order.append(f"{d}{b}")) for b in ("1", "8")} for d in "fb"}
    ms = dc.time_passes(passes, reps=2)
    assert order == ["f1", "b1", "f1", "b1", "f8", "b8", "f8", "b8"]
    assert set(ms) == {"f", "b"} and set(ms["f"]) == {"1", "8"}


def test_choice_is_measured_once_then_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    calls: list[Any] = []
    real = dc.calibration_passes

    def counted(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        calls.append(dtype)
        return real(cfg, dtype, batches=(1, 2))

    monkeypatch.setattr(dc, "calibration_passes", counted)
    first = dc.choose_dtype(TINY, torch.device("cpu"))
    assert sorted(map(str, calls)) == ["torch.bfloat16", "torch.float32"]
    assert first.dtype in ("float32", "bfloat16") and set(first.matmul_ms) == {
        "float32",
        "bfloat16",
    }
    again = dc.choose_dtype(TINY, torch.device("cpu"))
    assert len(calls) == 2 and again.dtype == first.dtype and again.reason.endswith("(cached)")
    assert (tmp_path / "dtype-choice.json").exists()


def test_processes_starting_together_calibrate_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two instances of `tidal up` start at once: one measures (alone: the other waits on the
    # lock rather than loading the CPU beside it), the other reads its answer
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    running, overlapped, measured = [0], [False], []
    guard = threading.Lock()

    def measure(cfg: ModelConfig) -> dc.DtypeChoice:
        with guard:
            running[0] += 1
            overlapped[0] |= running[0] > 1
        time.sleep(0.3)
        with guard:
            running[0] -= 1
        measured.append(1)
        return dc.decide({"float32": {"1": 2.0}, "bfloat16": {"1": 1.0}})

    monkeypatch.setattr(dc, "measure_candidates", measure)
    with cf.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda _: dc.choose_dtype(TINY, torch.device("cpu")), range(3)))
    assert measured == [1] and not overlapped[0]
    assert {c.dtype for c in got} == {"bfloat16"}
    assert sum(c.reason.endswith("(cached)") for c in got) == 2


def test_env_and_device_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_DTYPE", "float32")
    assert dc.choose_dtype(TINY, torch.device("cpu")).dtype == "float32"
    monkeypatch.delenv("TIDAL_DTYPE")
    assert dc.choose_dtype(TINY, torch.device("cuda")).dtype == "bfloat16"


def test_engine_reports_its_choice(
    make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_DTYPE", "float32")
    engine = make_engine("llama", dtype=None)
    assert engine.model.dtype == torch.float32
    assert engine.dtype_choice is not None and engine.dtype_choice.reason == "TIDAL_DTYPE"
    assert make_engine("llama").dtype_choice is None  # an explicit dtype: nothing chosen


def test_a_loaded_calibration_is_measured_again_once_the_machine_is_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an AVX2 host calibrated while other work ran cached fp32 without its bf16 copies (3x
    # slower at batch 1); the next start on a quiet machine measures again and keeps that
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    loaded = {"float32": {"1": 2.0, "8": 2.0}, "bfloat16": {"1": 1.9, "8": 8.0}}
    quiet = {"float32": {"1": 2.0, "8": 2.0}, "bfloat16": {"1": 0.6, "8": 8.0}}
    tables, others = [loaded, quiet], [1.4, 0.05]
    monkeypatch.setattr(dc, "calibration_passes", lambda cfg, dt: {})
    monkeypatch.setattr(dc, "time_passes", lambda passes: tables.pop(0))
    monkeypatch.setattr(dc.cpu_meter.OthersMeter, "cores", lambda self: others.pop(0))
    first = dc.choose_dtype(TINY, torch.device("cpu"))
    assert first.bf16_weight_rows == 0 and first.others_busy_cores == 1.4
    assert "beside 1.40 cores of other work" in first.reason
    # still loaded at the next start: the cached one, no calibration paid
    monkeypatch.setattr(dc.cpu_meter, "others_busy_now", lambda window_s=0.25: 0.9)
    assert dc.choose_dtype(TINY, torch.device("cpu")).reason.endswith("(cached)")
    assert len(tables) == 1
    # quiet: measured again, and that one is kept for good
    monkeypatch.setattr(dc.cpu_meter, "others_busy_now", lambda window_s=0.25: 0.02)
    second = dc.choose_dtype(TINY, torch.device("cpu"))
    assert not tables and second.bf16_weight_rows == 1 and second.others_busy_cores == 0.05
    third = dc.choose_dtype(TINY, torch.device("cpu"))
    assert third.reason.endswith("(cached)") and third.bf16_weight_rows == 1


def test_the_meter_counts_other_processes_not_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # the machine's busy time is this process's own (nothing else runs, as far as the meter can
    # tell): spinning for 0.3 s is not "other work"; 0.5 core of others on top reads as such
    meter_mod = dc.cpu_meter
    extra = [0.0]
    monkeypatch.setattr(meter_mod, "_machine_busy_s", lambda: meter_mod._own_s() + extra[0])
    meter = meter_mod.OthersMeter()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    assert REAL_CORES(meter) < 0.05
    meter = meter_mod.OthersMeter()
    time.sleep(0.2)
    extra[0] += 0.1  # others used 0.1 s of CPU in these 0.2 s
    assert 0.3 < REAL_CORES(meter) < 0.55
