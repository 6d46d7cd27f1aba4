"""Block allocator invariants under random sequences (hypothesis), alone and inside the engine."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch.kv_cache import BlockAllocator, NoFreeBlocksError, block_hashes

ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "finish", "preempt"]), st.integers(0, 7)),
    max_size=60,
)


@given(ops=ops, num_blocks=st.integers(1, 12))
def test_allocator_never_leaks_or_double_frees(ops: list[tuple[str, int]], num_blocks: int) -> None:
    bs = 4
    alloc = BlockAllocator(num_blocks, bs)
    tables: dict[int, list[int]] = {}  # seq -> block table
    prompts = {i: [i % 3] * (4 * (i % 4) + 3) for i in range(8)}  # shared prefixes across seqs
    for op, k in ops:
        if op == "admit" and k not in tables:
            hashes = block_hashes(prompts[k][:-1], bs)
            table = alloc.lookup(hashes)
            need = -(-len(prompts[k]) // bs) - len(table)
            if alloc.can_allocate(need):
                table += alloc.allocate(need)
                for b, h in zip(table, hashes, strict=False):
                    alloc.register(b, h)
                tables[k] = table
            else:
                with pytest.raises(NoFreeBlocksError):
                    alloc.allocate(need)
                alloc.free(table)
        elif op == "grow" and k in tables and alloc.can_allocate(1):
            tables[k] += alloc.allocate(1)
        elif op in ("finish", "preempt") and k in tables:
            alloc.free(tables.pop(k))
        alloc.check_integrity(list(tables.values()))
        assert alloc.num_used == len({b for t in tables.values() for b in t})
    for t in tables.values():
        alloc.free(t)
    alloc.check_integrity([])
    assert alloc.num_free == num_blocks
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([0])


engine_ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "abort", "swap", "swap", "preempt"]),
        st.integers(0, 5),
    ),
    min_size=5,
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=engine_ops)
def test_engine_random_admit_finish_preempt_keeps_kv_consistent(
    make_engine: Any, ops: list[tuple[str, int]]
) -> None:
    # 64 KV tokens for up to 6 requests of 8..33 prompt tokens: memory preemption happens.
    e = make_engine(kv_cache_tokens=64, block_size=8, chunk_size=8, token_budget=16)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for op, k in ops:
        rid = f"r{k}"
        if op == "add" and rid not in e.seqs:
            e.add(EngineRequest(rid, [k + 1] * (8 + 5 * k), sp))
        elif op == "step" and e.has_work():
            before = e.num_recompute_preemptions
            for _ in range(3):
                if e.has_work():
                    e.step()
            if e.num_recompute_preemptions > before:
                event("recompute preemption (KV full)")
        elif op == "abort":
            e.abort(rid)
        elif op == "swap" and rid in e.seqs:
            s = e.seqs[rid]
            if s.status == "running":
                e.swap_out(rid)
                event("swap out")
            elif s.status == "swapped" and e.allocator.can_allocate(
                -(-s.swapped_kv.shape[2] // 8) if s.swapped_kv is not None else 0
            ):
                e.swap_in(rid)
                event("swap in")
        elif op == "preempt" and e.has_work():
            e.model.layer_hook = lambda layer, n: layer == 1 and e.request_layer_cut()
            e.step()
            e.model.layer_hook = None
            if e.last_step_preempted:
                event("layer-boundary preemption")
        e.check_integrity()
    for rid in list(e.seqs):
        assert e.abort(rid)
    e.check_integrity()
    assert e.allocator.num_used == 0
