"""Chunks cut at a layer boundary, resumed as the engines resume them (OOCO §3.4.1).

An online arrival cuts a preemptible step (`StepPlan.layer_cut`) at its next layer boundary
(`Span.preempt_at_layer`). The torch and `sim` engines keep what the cut step computed: every
chunk in it (prefill chunks and decodes alike) has its KV written for the layers that ran, and
the request's next step runs the same chunk on from the layer where it stopped. Live, the engine
reports the request with its computed tokens where they were before the cut, the chunk's KV
blocks still held, and `SeqSnapshot.forced_tokens` = the chunk's size; the instance's executor
gives the request exactly that many tokens whatever the plan asked
(`tidal.engine.executor.fit_to_engine`). The simulator does the same: `Cuts` maps each such
request to (chunk tokens, layers done), and the step that resumes it pays the step's fixed part
once (`fixed_s`) plus, for each layer, that layer's share of the batch that runs it: the cut
chunks only from their layer on (`layered_step`, as `tidal.engine.sim.plan.layer_times`).
A chunk cut and resumed so costs its uncut step plus one step's fixed part.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.perf.api import BatchShape, StepModel

# req_id -> (tokens of its cut chunk, layers of it done); a request's chunk is dropped with its
# KV (recompute, release to a checkpoint, abort) and ends when a step that runs it is not cut.
Cuts = dict[str, tuple[int, int]]

_EMPTY = BatchShape()


def fixed_s(model: StepModel, shape: BatchShape) -> float:
    """Seconds of a step of `shape` run once, not per layer: the model's own `fixed_s` where it
    has one (the roofline's LM head and static overhead), else its empty step (a linear model's
    `base_s`), at most the step itself."""
    f = getattr(model, "fixed_s", None)
    if f is not None:
        return float(f(shape))
    return max(0.0, min(model.step_s(_EMPTY), model.step_s(shape)))


def shape_of(
    prefill: Sequence[tuple[int, int]], decode_ctx: Sequence[int], num_cpu: int
) -> BatchShape:
    """The batch of prefill chunks (tokens, tokens computed before), GPU decodes (their context)
    and CPU-attention decodes (GPU tokens, no context)."""
    p_tok = pairs = sq = 0
    for m, c in prefill:
        p_tok += m
        pairs += m * (c + m)
        sq += m * m
    return BatchShape(
        p_tok, len(prefill), pairs, len(decode_ctx) + num_cpu, sum(decode_ctx), prefill_sq_tokens=sq
    )


def layered_step(
    model: StepModel,
    prefill: Sequence[tuple[int, int, int]],  # (first layer, tokens, tokens computed before)
    decode: Sequence[tuple[int, int]],  # (first layer, context tokens)
    num_cpu: int,
    num_layers: int,
) -> tuple[float, float, list[tuple[int, float]]]:
    """A step whose entries start at different layers (resumed chunks at their cut layer):
    (its seconds, its fixed part, [(first layer, seconds per layer)] for each run of layers
    with the same batch). Layer l runs the entries that start at or before it."""
    full = shape_of([(m, c) for _, m, c in prefill], [c for _, c in decode], num_cpu)
    fixed = fixed_s(model, full)
    starts = sorted(
        {s for s, _, _ in prefill} | {s for s, _ in decode} | ({0} if num_cpu else set())
    )
    segs: list[tuple[int, float]] = []
    total = fixed
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else num_layers
        shape = shape_of(
            [(m, c) for st, m, c in prefill if st <= s], [c for st, c in decode if st <= s], num_cpu
        )
        per = max(0.0, model.step_s(shape) - fixed_s(model, shape)) / num_layers
        segs.append((s, per))
        total += per * (end - s)
    return total, fixed, segs


def layer_ends(
    t0: float, end_s: float, segs: Sequence[tuple[int, float]], num_layers: int
) -> list[float]:
    """End time of each layer that runs, from the first: the layers start at `t0` (after the
    step's copies and fixed part) and end at `end_s`, each as long as its share in `segs`."""
    widths: list[float] = []
    for i, (s, per) in enumerate(segs):
        end = segs[i + 1][0] if i + 1 < len(segs) else num_layers
        widths.extend([per] * (end - s))
    total = sum(widths)
    n = len(widths)
    scale = (end_s - t0) / total if total > 0 else 0.0
    out: list[float] = []
    t = t0
    for j, w in enumerate(widths):
        t = (
            end_s
            if j == n - 1
            else (t + w * scale if total > 0 else t0 + (end_s - t0) * (j + 1) / n)
        )
        out.append(t)
    return out
