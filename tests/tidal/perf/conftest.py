"""Small factories for the latency-model tests: a toy model whose arithmetic fits in a comment."""

from __future__ import annotations

import pytest

from tidal.perf.catalog import ModelSpec
from tidal.perf.roofline import RooflineParams


def make_toy_model(**kw: object) -> ModelSpec:
    # L=2, hidden 8, 2 query heads / 1 KV head of dim 4 (q_dim 8, kv_dim 4), MLP 16, vocab 32, d=2
    args: dict[str, object] = dict(
        name="toy", num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4,
        intermediate=16, vocab=32, bytes_per_value=2,
    )  # fmt: skip
    args.update(kw)
    return ModelSpec(**args)  # type: ignore[arg-type]


def make_toy_params(**kw: object) -> RooflineParams:
    args: dict[str, object] = dict(
        F_g=1000.0, F_ap=1000.0, F_ad=1000.0, M_g=100.0, M_a=100.0, O_p=1.0, O_d=0.5, B_c=1.0
    )
    args.update(kw)
    return RooflineParams(**args)  # type: ignore[arg-type]


@pytest.fixture
def toy_model() -> ModelSpec:
    return make_toy_model()


@pytest.fixture
def toy_params() -> RooflineParams:
    return make_toy_params()


def write_vidur_csv(path, model: ModelSpec, params: RooflineParams, tps, ns) -> None:  # type: ignore[no-untyped-def]
    """A per-operator timing CSV in vidur's format whose GEMM times come from `params`."""
    from tidal.perf.kernel_timings import GEMM_OPS, OTHER_OPS
    from tidal.perf.roofline import RooflineModel

    ops = [*GEMM_OPS, *OTHER_OPS]
    head = [f"time_stats.{o}.{s}" for o in ops for s in ("min", "max", "mean", "median", "std")]
    head += ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp",
             "num_tokens", "num_tensor_parallel_workers"]  # fmt: skip
    lines = [",".join(head)]
    for tp in tps:
        rm = RooflineModel(model, params, tp)
        for n in ns:
            gemm = rm.gemm_s(n)
            vals = []
            for i, _ in enumerate(ops):
                ms = (gemm[i] if i < 4 else 1e-6 * (1 + n / 1000)) * 1e3
                vals += [ms, ms, ms, ms, 0.0]
            vals += [model.num_heads, model.num_kv_heads, model.hidden, model.intermediate,
                     model.vocab, "True", n, tp]  # fmt: skip
            lines.append(",".join(str(v) for v in vals))
    path.write_text("\n".join(lines) + "\n")
