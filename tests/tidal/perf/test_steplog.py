from __future__ import annotations

import json

import numpy as np
import pytest

from tidal.perf.api import BatchShape
from tidal.perf.catalog import model_spec
from tidal.perf.kernel_timings import read_kernel_timings
from tidal.perf.roofline import RooflineParams
from tidal.perf.steplog import read_step_log, record_to_batch, synthetic_step_log, write_step_log

from .conftest import write_vidur_csv


def test_round_trip(tmp_path) -> None:
    batches = [BatchShape(10, 1, 150, 2, 50, 100), BatchShape(0, 0, 0, 5, 4000)]
    write_step_log(tmp_path / "s.jsonl", batches, [0.1, 0.2])
    log = read_step_log(tmp_path / "s.jsonl")
    assert log.batches == batches
    assert log.step_s.tolist() == [0.1, 0.2]


def test_plain_step_telemetry_fields_are_enough() -> None:
    # only StepTelemetry's fields: N_p = requests - decodes; decode context = context - prefill;
    # pairs = S_p² / N_p (equal chunks from empty caches)
    r = {"num_prefill_tokens": 100, "num_decode_tokens": 3, "num_context_tokens": 1100,
         "num_requests": 5, "step_s": 0.05, "module_s": {}}  # fmt: skip
    assert record_to_batch(r) == BatchShape(100, 2, 5000, 3, 1000)


def test_bad_line_names_its_place(tmp_path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"step_s": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_step_log(p)


def test_synthetic_log_uses_the_measured_dense_time(tmp_path) -> None:
    m = model_spec("llama-2-7b")
    params = RooflineParams(2e14, 1e14, 1e13, 2e12, 1.5e12, 0, 0, 1e11)
    write_vidur_csv(tmp_path / "k.csv", m, params, [1], [1, 64, 512])
    kt = read_kernel_timings(tmp_path / "k.csv")
    log = synthetic_step_log(kt, num_layers=32, num_steps=300, noise=0.0, overhead_s=0.0)
    dense = np.sum(list(kt.op_s.values()), axis=0)
    for b, t in zip(log.batches, log.step_s, strict=True):
        assert b.num_tokens in (1, 64, 512)
        assert b.num_decode_reqs <= 256
        i = int(np.flatnonzero(kt.num_tokens == b.num_tokens)[0])
        assert t >= 32 * dense[i]  # attention only adds
