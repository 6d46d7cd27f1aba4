"""BatchShape arithmetic shared by the co-location policies (OOCO, HyGen, TaiChi, OmniServe, Tidal).

Every algorithm in the four papers asks the same question — "how long would this step take if I
added that request?" — so they all build a `tidal.perf.BatchShape` incrementally and hand it to a
`StepModel`. These helpers keep that arithmetic in one place and allocation-light.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

from tidal.perf.api import BatchShape

EMPTY = BatchShape()


def add_decode(shape: BatchShape, num_reqs: int, context_tokens: int) -> BatchShape:
    """`shape` plus `num_reqs` decoding requests whose KV lengths sum to `context_tokens`."""
    return BatchShape(
        num_prefill_tokens=shape.num_prefill_tokens,
        num_prefill_reqs=shape.num_prefill_reqs,
        prefill_attn_pairs=shape.prefill_attn_pairs,
        num_decode_reqs=shape.num_decode_reqs + num_reqs,
        decode_context_tokens=shape.decode_context_tokens + context_tokens,
    )


def add_prefill(shape: BatchShape, new_tokens: int, cached_tokens: int) -> BatchShape:
    """`shape` plus one prefill chunk of `new_tokens` after `cached_tokens` already in KV."""
    if new_tokens <= 0:
        return shape
    return BatchShape(
        num_prefill_tokens=shape.num_prefill_tokens + new_tokens,
        num_prefill_reqs=shape.num_prefill_reqs + 1,
        prefill_attn_pairs=shape.prefill_attn_pairs + new_tokens * (cached_tokens + new_tokens),
        num_decode_reqs=shape.num_decode_reqs,
        decode_context_tokens=shape.decode_context_tokens,
    )


def merge(a: BatchShape, b: BatchShape) -> BatchShape:
    """The step that runs both `a` and `b`."""
    return BatchShape(
        num_prefill_tokens=a.num_prefill_tokens + b.num_prefill_tokens,
        num_prefill_reqs=a.num_prefill_reqs + b.num_prefill_reqs,
        prefill_attn_pairs=a.prefill_attn_pairs + b.prefill_attn_pairs,
        num_decode_reqs=a.num_decode_reqs + b.num_decode_reqs,
        decode_context_tokens=a.decode_context_tokens + b.decode_context_tokens,
    )


def decode_shape(context_lens: list[int]) -> BatchShape:
    """A pure decode step over requests with these KV lengths."""
    return BatchShape(num_decode_reqs=len(context_lens), decode_context_tokens=sum(context_lens))


def largest_fit(
    f: Callable[[int], float], n: int, limit: float, x: Sequence[int] | None = None
) -> tuple[int, float]:
    """Largest k in [0, n] with f(k) <= limit, for f non-decreasing; returns (k, f(k)).

    Every scheduling search of the four papers is this question with f = "step latency with the
    first k candidates added" (OOCO Alg. 2's sorted binary search, HyGen's get_max_prefill and
    decode prefix, OmniServe's chunk binary search). A step-latency model costs microseconds per
    call, so the number of calls is the decision's cost: we try all n first (the common case
    below saturation), then guess by linear interpolation between the bracketing points (step
    latency is near-linear in tokens and requests) and confirm the neighbour, falling back to
    bisection whenever a guess fails to halve the bracket. The answer is the same as plain
    bisection's for any monotone f; typically 3-4 calls instead of log2(n).

    `x` (n + 1 non-decreasing values, optional) is the abscissa to interpolate in when latency
    is closer to linear in it than in k: e.g. the KV tokens of the first k decodes, when the
    candidates are sorted by length (latency is then convex in k but near-linear in KV read).
    """
    f0 = f(0)
    if n <= 0 or f0 > limit:
        return 0, f0
    fn = f(n)
    if fn <= limit:
        return n, fn
    lo, flo, hi, fhi = 0, f0, n, fn  # invariant: f(lo) <= limit < f(hi)
    bisect = False
    while hi - lo > 1:
        width = hi - lo
        if bisect:
            g = (lo + hi) // 2
        else:
            frac = (limit - flo) / (fhi - flo)
            if x is None:
                g = lo + int(frac * width)
            else:
                g = bisect_right(x, x[lo] + frac * (x[hi] - x[lo]), lo, hi) - 1
            g = min(max(g, lo + 1), hi - 1)
        fg = f(g)
        if fg <= limit:
            lo, flo = g, fg
            if not bisect and g + 1 < hi:  # confirm the neighbour: often ends the search
                f1 = f(g + 1)
                if f1 > limit:
                    hi, fhi = g + 1, f1
                else:
                    lo, flo = g + 1, f1
        else:
            hi, fhi = g, fg
            if not bisect and g - 1 > lo:
                f1 = f(g - 1)
                if f1 <= limit:
                    lo, flo = g - 1, f1
                else:
                    hi, fhi = g - 1, f1
        bisect = not bisect and 2 * (hi - lo) > width  # guess did not halve it: bisect once
    return lo, flo
