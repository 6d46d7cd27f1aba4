from __future__ import annotations

import pytest

from services.instance.engines import parse_step_model
from tidal.engine.sim import LinearStepModel
from tidal.perf.api import BatchShape


def test_step_model_specs() -> None:
    assert parse_step_model("zero").step_s(BatchShape(num_decode_reqs=8)) == 0.0
    assert parse_step_model("linear") == LinearStepModel()
    custom = parse_step_model("linear:0.01,0.001,0.002,0")
    # 0.01 + 100*0.001 + 2*0.002 = 0.114 s
    assert custom.step_s(BatchShape(num_prefill_tokens=100, num_decode_reqs=2)) == pytest.approx(
        0.114
    )
    perf_model = parse_step_model("llama-2-7b@a100-80gb")
    assert perf_model.step_s(BatchShape(num_decode_reqs=1, decode_context_tokens=100)) > 0


@pytest.mark.parametrize("bad", ["fast", "linear:1,2", "linear:a,b,c,d", "linear:-1,0,0,0"])
def test_bad_step_model_specs_are_clear_errors(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_step_model(bad)
