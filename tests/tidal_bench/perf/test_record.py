from __future__ import annotations

import json

import pytest

from tidal.perf.steplog import read_step_log
from tidal_bench.perf.record import record_engine_log


@pytest.mark.slow
def test_records_real_engine_steps_that_the_fits_can_read(tmp_path) -> None:
    out = tmp_path / "steps.jsonl"
    record_engine_log(
        str(out),
        num_steps=8,
        max_prompt=48,
        max_output=4,
        chunks=(16, 32),
        clock="thread",
        populations=(3,),
    )
    log = read_step_log(out)
    assert all("wall_s" in json.loads(line) for line in out.read_text().splitlines())
    assert len(log) == 8
    assert all(t > 0 for t in log.step_s)
    assert any(b.num_prefill_tokens > 0 for b in log.batches)
    # chunks of at most 32 tokens per step (or one whole <= 48-token prompt when nothing else)
    assert all(b.num_prefill_tokens <= 48 for b in log.batches)
    assert all(b.num_prefill_reqs + b.num_decode_reqs <= 3 for b in log.batches)  # population


@pytest.mark.parametrize(
    ("populations", "kv", "says"),
    [((), 65536, "populations"), ((0, 4), 65536, "populations"), ((200,), 65536, "KV tokens")],
)
def test_populations_are_checked_before_the_engine_loads(
    tmp_path, populations: tuple[int, ...], kv: int, says: str
) -> None:
    with pytest.raises(ValueError, match=says):  # 200 x (256 + 256) tokens > 65,536
        record_engine_log(
            str(tmp_path / "s.jsonl"),
            max_prompt=256,
            max_output=256,
            populations=populations,
            kv_cache_tokens=kv,
        )
    assert not (tmp_path / "s.jsonl").exists()
