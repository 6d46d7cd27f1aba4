"""HyGen algorithms on hand-worked states (papers/hygen.md §4, App. A)."""

from __future__ import annotations

import random

import pytest

from tidal.perf.linear import LinearStepModel
from tidal.policy.hygen import (
    HyReq,
    OfflineOrder,
    PrefixTrie,
    profile_budget_from_above,
    profile_latency_budget,
    reconcile_on_arrival,
    two_phase_schedule,
)

# 10 ms + 0.1 ms per token through the GEMMs: a 50 ms budget holds 400 tokens.
TOK = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


def dec(rid: str, ctx: int = 64) -> HyReq:
    return HyReq(rid, ctx, ctx, ctx // 16)  # decoding, holding exactly its blocks


def test_two_phase_online_first_then_offline_chunked_into_the_remaining_budget() -> None:
    b = two_phase_schedule(
        TOK, 0.05, 512, 16, 10_000,
        online_running=[dec("on-d1"), dec("on-d2")],
        online_waiting=[HyReq("on-p", 300)],
        offline_running=[],
        offline_waiting=[HyReq("off-a", 200), HyReq("off-b", 50)],
    )  # fmt: skip
    # Online: 2 decodes + 300-token prefill = 302 tokens. Offline: 10 + 0.1*(302 + l) <= 50 ms
    # -> l = 98 of off-a, chunked; off-b finds l = 0 and the loop stops (Alg. 1 line 26).
    assert b.decode == ["on-d1", "on-d2"]
    assert b.prefill == {"on-p": 300, "off-a": 98}
    assert b.step_s == pytest.approx(0.05)
    assert not b.preempted


def test_online_decodes_are_never_dropped_even_over_budget() -> None:
    online = [dec(f"d{i}") for i in range(500)]  # 500 tokens -> 60 ms > 50 ms budget
    b = two_phase_schedule(TOK, 0.05, 1024, 16, 10_000, online, [], [dec("off-d")], [])
    assert len(b.decode) == 500 and "off-d" not in b.decode


def test_unbudgeted_online_chunk_is_cut_by_the_chunk_size_only_and_offline_adds_nothing() -> None:
    # 30 ms budget = 200 tokens. One online decode + a 400-token prompt, chunk 512.
    def step(budgeted: bool, prompt: int) -> tuple[dict[object, int], float]:
        b = two_phase_schedule(
            TOK, 0.03, 512, 16, 10_000,
            online_running=[dec("on-d")],
            online_waiting=[HyReq("on-p", prompt)],
            offline_running=[dec("off-d")],
            offline_waiting=[HyReq("off-a", 400)],
            online_prefill_budgeted=budgeted,
        )  # fmt: skip
        return b.prefill, b.step_s

    # Alg. 1 line 15 as written: the budget cuts the online chunk to 199 tokens (1 + 199).
    assert step(True, 400) == ({"on-p": 199}, pytest.approx(0.03))
    # The online phase bounded by chunk and memory only: the whole 400-token prompt goes in
    # (41.1 ms, as Sarathi would run it) and the offline phase adds nothing to an over-budget step.
    assert step(False, 400) == ({"on-p": 400}, pytest.approx(0.01 + 1e-4 * 401))
    # A light online step is topped up to the budget with offline work either way: 1 + 50
    # online tokens, then the offline decode and 148 tokens of off-a (10 + 0.1 * 200 = 30 ms).
    for budgeted in (True, False):
        assert step(budgeted, 50) == ({"on-p": 50, "off-a": 148}, pytest.approx(0.03))


def test_offline_preempted_newest_first_when_online_needs_its_memory() -> None:
    # 10 free blocks; two offline prefills hold 20 blocks each. The online prompt needs 25 blocks.
    off = [HyReq("old", 640, 320, 20), HyReq("new", 640, 320, 20)]
    b = two_phase_schedule(TOK, 1.0, 4096, 16, 10, [], [HyReq("on", 400)], off, [])
    assert b.prefill["on"] == 400
    assert b.preempted == ["new"]  # freeing 20 blocks is enough; 'old' keeps running
    assert "old" in b.prefill


def test_async_reconcile_drops_offline_entries_last_first_on_arrival() -> None:
    planned = two_phase_schedule(
        TOK, 0.05, 512, 16, 10_000, [dec("on-d")], [],
        [], [HyReq("off-a", 100), HyReq("off-b", 200)],
    )  # fmt: skip
    assert planned.prefill == {"off-a": 100, "off-b": 200}
    # An online prompt of 150 arrives: 1 + 150 online tokens; the step must drop 'off-b' (last
    # planned) -> 1 + 150 + 100 = 251 tokens = 35.1 ms <= 50 ms.
    got = reconcile_on_arrival(
        TOK, planned, [HyReq("on-new", 150)], 0.05, 512, 16, 10_000, {"off-a", "off-b"}
    )
    assert got.prefill == {"off-a": 100, "on-new": 150}
    assert got.decode == ["on-d"]
    assert got.step_s == pytest.approx(0.01 + 1e-4 * 251)


def test_unbudgeted_reconcile_sizes_arrivals_by_chunk_and_memory_like_the_main_builder() -> None:
    # Planned one step ahead: an online decode, then off-a (100 tokens, 7 blocks) and off-b
    # (200 tokens, 13 blocks) within the 50 ms budget.
    planned = two_phase_schedule(
        TOK, 0.05, 512, 16, 10_000, [dec("on-d")], [],
        [], [HyReq("off-a", 100), HyReq("off-b", 200)],
    )  # fmt: skip
    off = {"off-a", "off-b"}

    def arrive(budgeted: bool, free: int, *prompts: int) -> tuple[dict[object, int], float]:
        new = [HyReq(f"on-{i}", p) for i, p in enumerate(prompts)]
        got = reconcile_on_arrival(TOK, planned, new, 0.05, 512, 16, free, off, budgeted)
        assert got.decode == ["on-d"]
        return got.prefill, got.step_s

    # Alg. 1 line 15 as written: the 50 ms budget cuts a 600-token prompt to 399 (1 + 399 tokens)
    # and leaves no room for offline work.
    assert arrive(True, 10_000, 600) == ({"on-0": 399}, pytest.approx(0.05))
    # Unbudgeted (as `two_phase_schedule` runs the online phase): the chunk the online decode
    # leaves, 511 tokens; the over-budget step keeps no offline entry.
    assert arrive(False, 10_000, 600) == ({"on-0": 511}, pytest.approx(0.01 + 1e-4 * 512))
    # Memory: 10 free blocks plus the 20 the dropped offline entries would take = 480 tokens.
    assert arrive(False, 10, 600)[0] == {"on-0": 480}
    # Two arrivals share the online chunk: 300, then the 211 tokens left of it.
    assert arrive(False, 10_000, 300, 300)[0] == {"on-0": 300, "on-1": 211}
    # A short arrival keeps the planned offline work either way: 1 + 50 + 100 + 200 = 351
    # tokens, 45.1 ms within the budget.
    for budgeted in (True, False):
        assert arrive(budgeted, 10_000, 50) == (
            {"off-a": 100, "off-b": 200, "on-0": 50},
            pytest.approx(0.01 + 1e-4 * 351),
        )


# Paper §4.3 example, tokens as words: What=1 is=2 ML=3 AI=7; How=4 to=5 code=6 debug=8.
EXAMPLE = {"What is ML": (1, 2, 3), "How to code": (4, 5, 6), "What is AI": (1, 2, 7)}


def test_prefix_trie_dfs_order_groups_shared_prefixes() -> None:
    t = PrefixTrie()
    for name, toks in [*EXAMPLE.items(), ("How to debug", (4, 5, 8))]:
        t.insert(name, toks)
    assert t.dfs_order() == ["What is ML", "What is AI", "How to code", "How to debug"]
    assert t.next_request() == "What is ML"
    t.insert("What is", (1, 2))  # a shorter prefix sits above its extensions (edge split)
    assert t.dfs_order() == ["What is", "What is ML", "What is AI", "How to code", "How to debug"]
    for name in ("What is", "What is ML", "What is AI"):
        t.remove(name)
    assert t.next_request() == "How to code"
    assert len(t) == 2


def test_freshness_utility_ratio_against_starvation() -> None:
    arrivals = [("What is ML", (1, 2, 3)), ("What is AI", (1, 2, 7)), ("How to code", (4, 5, 6))]
    arrivals += [
        ("What is DL", (1, 2, 9)),
        ("What is LLM", (1, 2, 10)),
        ("What is DNN", (1, 2, 11)),
    ]

    def order(u: float) -> list[str]:
        o = OfflineOrder(prefix_sharing=True, utility_ratio=u, rng=random.Random(1))
        for i, (name, toks) in enumerate(arrivals):
            o.add(name, toks, float(i))
        return [str(r) for r in o.drain(10)]

    # u = 1 (plain A.2): 'How to code' waits behind every 'What is' request.
    assert order(1.0).index("How to code") == 5
    # u = 0: pure freshness, i.e. arrival order.
    assert order(0.0) == [name for name, _ in arrivals]
    # In between it is served earlier than under u = 1 (seeded draw).
    assert order(0.3).index("How to code") < 5


def test_profiler_binary_searches_the_largest_compliant_budget() -> None:
    got = profile_latency_budget(lambda b: b <= 0.073, 0.01, 0.2, iterations=20)
    assert got is not None and got == pytest.approx(0.073, abs=1e-6) and got <= 0.073
    assert profile_latency_budget(lambda b: False, 0.01, 0.2) is None


def test_profiler_from_above_finds_the_largest_budget_when_the_bottom_fails_too() -> None:
    # A TTFT-like SLO: met only in [0.03, 0.073] (too small a budget starves online prefill).
    seen: list[float] = []

    def meets(b: float) -> bool:
        seen.append(b)
        return 0.03 <= b <= 0.073

    got = profile_budget_from_above(meets, 0.005, 0.2, shrink=0.5, iterations=10)
    # 0.2 and 0.1 fail, 0.05 meets; bisection between 0.05 and 0.1 closes on 0.073.
    assert seen[:3] == [0.2, 0.1, 0.05]
    assert got is not None and got <= 0.073 and got == pytest.approx(0.073, abs=1e-4)
    # profile_latency_budget tests the bottom first and gives up on the same SLO.
    assert profile_latency_budget(lambda b: 0.03 <= b <= 0.073, 0.005, 0.2) is None


def test_profiler_from_above_takes_the_top_or_reports_none() -> None:
    assert profile_budget_from_above(lambda b: True, 0.01, 0.2) == 0.2
    calls: list[float] = []
    assert profile_budget_from_above(lambda b: bool(calls.append(b)), 0.01, 0.2, 0.5) is None
    assert min(calls) >= 0.01 and len(calls) == 5  # 0.2, 0.1, 0.05, 0.025, 0.0125
    with pytest.raises(ValueError, match="shrink"):
        profile_budget_from_above(lambda b: True, 0.01, 0.2, shrink=1.0)
