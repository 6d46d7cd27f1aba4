from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.perf.api import BatchShape
from tidal.perf.catalog import hardware_spec, model_spec
from tidal.perf.factory import make_step_model
from tidal.perf.helpers import (
    add_prefill,
    kv_capacity_blocks,
    kv_capacity_tokens,
    max_prefill_tokens,
)

ROOF = make_step_model("llama-3-8b", "a100-80gb")


def test_add_prefill_arithmetic() -> None:
    b = add_prefill(BatchShape(num_decode_reqs=2, decode_context_tokens=50), 10, cached_tokens=5)
    # one chunk of 10 after 5 cached: pairs 10·(5+10) = 150, squares 100
    assert b == BatchShape(10, 1, 150, 2, 50, 100)


@settings(max_examples=40, deadline=None)
@given(
    budget_ms=st.floats(5, 400),
    nd=st.integers(0, 128),
    cached=st.integers(0, 4000),
)
def test_max_prefill_is_the_inverse_of_step_s(budget_ms: float, nd: int, cached: int) -> None:
    base = BatchShape(num_decode_reqs=nd, decode_context_tokens=nd * 900)
    budget = budget_ms / 1e3
    n = max_prefill_tokens(ROOF, budget, base, cached, limit=8192)
    if n > 0:
        assert ROOF.step_s(add_prefill(base, n, cached)) <= budget
    if n < 8192:
        assert ROOF.step_s(add_prefill(base, n + 1, cached)) > budget


def test_kv_capacity_hand_worked() -> None:
    m, hw = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    # (0.9 · 80 GiB - 6.738e9 params · 2 B) / 524,288 B per token
    expect = int((0.9 * 80 * 2**30 - m.num_params * 2) // 524_288)
    assert kv_capacity_tokens(m, hw) == expect
    assert kv_capacity_blocks(m, hw, block_tokens=16) == expect // 16
    with pytest.raises(ValueError):
        kv_capacity_tokens(m, hw, mem_fraction=0.0)
