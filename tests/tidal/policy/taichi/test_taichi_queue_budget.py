"""TaiChi Alg. 2's Estimate and queue on hand-worked states (papers/taichi.md §3.4): decodes draw
on the chunk budget first, and a partially prefilled prompt still counts as queued work."""

from __future__ import annotations

import math

import pytest

from tidal.perf.api import BatchShape
from tidal.perf.linear import LinearStepModel
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState, RequestClass
from tidal.policy.taichi import PrefillTarget, estimate_prefill_s, route_prefill
from tidal.policy.taichi.policy import queued_prefill

TOK = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)


def decodes(n: int) -> BatchShape:
    return BatchShape(num_decode_reqs=n, decode_context_tokens=100 * n)


def test_decodes_shrink_the_prefill_share_of_the_chunk() -> None:
    # Chunk 100 with 40 decodes: 60 prompt tokens a step. 120 tokens = 2 steps of
    # 10 ms + 100 tokens x 0.1 ms = 20 ms each -> 40 ms (an idle instance needs 2 x 20 + 0 ms).
    assert estimate_prefill_s(TOK, 120, 100, decodes(40)) == pytest.approx(0.040)
    # 130 tokens: 2 full steps + 10 tokens beside the 40 decodes (10 + 5 ms) -> 55 ms.
    assert estimate_prefill_s(TOK, 130, 100, decodes(40)) == pytest.approx(0.055)


def test_a_budget_full_of_decodes_never_prefills() -> None:
    assert estimate_prefill_s(TOK, 1, 100, decodes(100)) == math.inf
    assert estimate_prefill_s(TOK, 0, 100, decodes(100)) == 0.0


def test_d_heavy_whose_budget_is_taken_by_decodes_is_not_feasible() -> None:
    # D-heavy chunk 128 holding 128 decodes cannot prefill, so the short request that Alg. 2
    # would degrade there (emptier queue) goes to the P-heavy instance instead.
    p = PrefillTarget(0, True, 1024, [500], decodes(10), TOK)
    d_busy = PrefillTarget(1, False, 128, [], decodes(128), TOK)
    assert route_prefill(200, [p, d_busy], 3.0, 0.01) == 0
    d_free = PrefillTarget(1, False, 128, [], decodes(20), TOK)
    assert route_prefill(200, [p, d_free], 3.0, 0.01) == 1


def _req(rid: str, prompt: int, computed: int, out: int, phase: Phase) -> ReqState:
    r = ReqState(rid, RequestClass.ONLINE, 0.0, prompt, 100)
    r.phase, r.num_computed_tokens, r.num_output_tokens = phase, computed, out
    return r


def test_queue_counts_the_unfinished_prompt_of_a_running_request() -> None:
    inst = InstanceState(1, InstanceRole.D_HEAVY, 128, 256, 16, 1000, 1000, TOK, 1, 1e9)
    inst.running = [
        _req("dec", 50, 60, 11, Phase.RUNNING),  # decoding: no prefill left
        _req("pre", 1500, 256, 0, Phase.RUNNING),  # two chunks in: 1244 tokens left
    ]
    inst.waiting = [_req("w", 300, 0, 0, Phase.WAITING)]
    assert queued_prefill(inst) == [1244, 300]
