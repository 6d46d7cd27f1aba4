"""TaiChi Alg. 2 with the queue lower bound gives the same instance as the plain transcription
of Alg. 2 (papers/taichi.md §3.4) on random states, and the bound never exceeds the queue's
estimate."""

from __future__ import annotations

import random
from collections.abc import Sequence

from tidal.perf import make_step_model
from tidal.policy.batch_shape import decode_shape
from tidal.policy.taichi import PrefillTarget, estimate_prefill_s, route_prefill
from tidal.policy.taichi.routing import queue_lower_bound_s

MODEL = make_step_model("qwen2.5-14b", "a100-80gb")


def plain_alg2(
    prompt: int, targets: Sequence[PrefillTarget], slo: float, transfer: float
) -> int | None:
    """Alg. 2 lines 1-15 as written: every instance's Q + E + T, then the feasible one with
    the fewest queued tokens (ties by id)."""
    feasible = []
    for t in targets:
        q = sum(estimate_prefill_s(t.model, n, t.chunk_tokens, t.decode) for n in t.queued_tokens)
        e = estimate_prefill_s(t.model, prompt, t.chunk_tokens, t.decode)
        if q + e + (transfer if t.is_p_heavy else 0.0) < slo:
            feasible.append((sum(t.queued_tokens), t.instance_id))
    return min(feasible)[1] if feasible else None


def random_targets(rng: random.Random) -> list[PrefillTarget]:
    out = []
    for i in range(rng.randint(1, 6)):
        ctx = [rng.randint(50, 4000) for _ in range(rng.choice([0, 4, 64, 200]))]
        queued = [rng.randint(1, 2048) for _ in range(rng.randint(0, 12))]
        chunk = rng.choice([128, 256, 512, 1024, 2048])
        out.append(PrefillTarget(i, rng.random() < 0.5, chunk, queued, decode_shape(ctx), MODEL))
    return out


def test_same_instance_as_plain_alg2_on_random_states() -> None:
    rng = random.Random(7)
    answers = set()
    for _ in range(1500):
        targets = random_targets(rng)
        prompt = rng.randint(1, 2048)
        slo = rng.choice([0.5, 1.0, 2.0, 4.0])
        got = route_prefill(prompt, targets, slo, 0.02)
        assert got == plain_alg2(prompt, targets, slo, 0.02)
        answers.add(got is None)
    assert answers == {True, False}  # both feasible and infeasible states were exercised


def test_bound_is_below_the_queue_estimate() -> None:
    rng = random.Random(3)
    for t in (t for _ in range(300) for t in random_targets(rng)):
        exact = sum(estimate_prefill_s(MODEL, n, t.chunk_tokens, t.decode) for n in t.queued_tokens)
        assert queue_lower_bound_s(MODEL, t.queued_tokens, t.chunk_tokens, t.decode) <= exact
