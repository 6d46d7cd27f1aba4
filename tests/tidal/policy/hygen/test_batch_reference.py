"""`two_phase_schedule` (papers/hygen.md Alg. 1 run twice as in App. A.1 Alg. 2) against a plain
per-request transcription of the same algorithm on random states: the fast paths (bulk decodes,
interpolated searches, the one-token check, lazy contexts) must not change any decision."""

from __future__ import annotations

import random

import pytest

from tidal.perf import make_step_model
from tidal.perf.api import BatchShape, StepModel
from tidal.perf.linear import LinearStepModel
from tidal.policy.batch_shape import add_decode, add_prefill
from tidal.policy.hygen.batch import HyReq, two_phase_schedule

BS = 16


def _blocks(tokens: int) -> int:
    return -(-tokens // BS)


class _Ref:
    """Alg. 1 one request at a time: latency t, chunk c, memory m, as the paper writes it."""

    def __init__(self, model: StepModel, t: float, c: int, m: int) -> None:
        self.model, self.t, self.c, self.m = model, t, c, m
        self.shape = BatchShape()
        self.decode: list[object] = []
        self.prefill: dict[object, int] = {}
        self.context: dict[object, int] = {}

    def decode_one(self, r: HyReq) -> bool:
        """An offline decode (Alg. 1 lines 6-11, OFFLINE phase): within t, c and m."""
        need = max(0, _blocks(r.computed_tokens + 1) - r.held_blocks)
        cand = add_decode(self.shape, 1, r.computed_tokens)
        if need > self.m or self.c < 1 or self.model.step_s(cand) > self.t:
            return False
        self.shape, self.m, self.c = cand, self.m - need, self.c - 1
        self.decode.append(r.req_id)
        self.context[r.req_id] = r.computed_tokens
        return True

    def max_prefill(self, r: HyReq) -> int:
        slack = max(0, r.held_blocks * BS - r.computed_tokens)
        hi = min(self.c, r.prompt_tokens - r.computed_tokens, slack + self.m * BS)
        lo = 0  # plain bisection: the largest k <= hi whose step fits t
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.model.step_s(add_prefill(self.shape, mid, r.computed_tokens)) <= self.t:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def prefills(self, reqs: list[HyReq]) -> None:
        for r in reqs:
            n = self.max_prefill(r)
            if n <= 0:
                return  # Alg. 1 line 26
            self.shape = add_prefill(self.shape, n, r.computed_tokens)
            self.c -= n
            self.m -= max(0, _blocks(r.computed_tokens + n) - r.held_blocks)
            self.prefill[r.req_id] = n
            self.context[r.req_id] = r.computed_tokens


def _reference(
    model: StepModel,
    t: float,
    c: int,
    free: int,
    on_run: list[HyReq],
    on_wait: list[HyReq],
    off_run: list[HyReq],
    off_wait: list[HyReq],
) -> tuple[list[object], dict[object, int], list[object], dict[object, int]]:
    off_held = sum(r.held_blocks for r in off_run)
    ref = _Ref(model, t, c, free + off_held)
    for r in on_run:
        if r.computed_tokens >= r.prompt_tokens:
            need = max(0, _blocks(r.computed_tokens + 1) - r.held_blocks)
            if need <= ref.m:  # ONLINE phase (line 8): memory is the only limit
                ref.shape = add_decode(ref.shape, 1, r.computed_tokens)
                ref.m -= need
                ref.c -= 1
                ref.decode.append(r.req_id)
                ref.context[r.req_id] = r.computed_tokens
    ref.prefills([r for r in on_run if r.computed_tokens < r.prompt_tokens] + on_wait)
    kept, preempted = list(off_run), []
    while ref.m < off_held and kept:
        v = kept.pop()
        off_held -= v.held_blocks
        preempted.append(v.req_id)
    ref.m -= off_held
    for r in kept:
        if r.computed_tokens >= r.prompt_tokens and not ref.decode_one(r):
            break  # the longest prefix of offline decodes that fits
    ref.prefills([r for r in kept if r.computed_tokens < r.prompt_tokens] + off_wait)
    return ref.decode, ref.prefill, preempted, ref.context


def _reqs(rng: random.Random, tag: str, n: int, kind: str) -> list[HyReq]:
    out = []
    for i in range(n):
        p = rng.randint(1, 3000)
        mixed = rng.choice([0, rng.randint(0, p), p + rng.randint(0, 50)])
        c = {"dec": p + rng.randint(0, 200), "wait": 0}.get(kind, mixed)
        held = 0 if kind == "wait" else max(0, _blocks(c) + rng.choice([0, 0, 1, -1]))
        out.append(HyReq(f"{tag}{i}", p, c, held))
    return out


@pytest.mark.parametrize("model_name", ["linear", "roofline"])
def test_two_phase_schedule_matches_the_per_request_algorithm(model_name: str) -> None:
    model: StepModel = (
        LinearStepModel() if model_name == "linear" else make_step_model("llama-2-7b", "a100-40gb")
    )
    rng = random.Random(7)
    for _ in range(300):
        t = rng.choice([0.02, 0.05, 0.1, 0.3])
        c = rng.choice([128, 512, 2048])
        free = rng.choice([0, 8, 64, 512, 100_000])
        on_run = _reqs(rng, "on", rng.randint(0, 40), rng.choice(["dec", "mix"]))
        on_wait = _reqs(rng, "onw", rng.randint(0, 3), "wait")
        off_run = _reqs(rng, "off", rng.randint(0, 60), rng.choice(["dec", "mix"]))
        off_wait = _reqs(rng, "offw", rng.randint(0, 5), "wait")
        b = two_phase_schedule(model, t, c, BS, free, on_run, on_wait, off_run, off_wait)
        dec, pre, preempted, ctx = _reference(model, t, c, free, on_run, on_wait, off_run, off_wait)
        assert b.decode == dec
        assert b.prefill == pre
        assert b.preempted == preempted
        assert b.context == ctx
