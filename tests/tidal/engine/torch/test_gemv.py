"""The one-row matmul (`tidal.engine.torch.gemv`): the native bf16 GEMV against an fp32
reference, the same bits on any thread count, ATen's GEMV where the kernel does not fit."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal.engine.torch import gemv, native, packed

pytestmark = pytest.mark.skipif(native.load() is None, reason="needs a C++ compiler")


def _case(n_out: int, n_in: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n_in, generator=g).to(torch.bfloat16)
    w = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(torch.bfloat16)
    b = torch.randn(n_out, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """In fp64 from the same bf16 values, rounded once to bf16."""
    y = x.double() @ w.double().t()
    return (y if b is None else y + b.double()).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("n_out", "n_in", "bias"),
    [(960, 576, True), (576, 576, False), (3072, 576, False), (576, 1536, False), (7, 32, True)],
)
def test_native_gemv_is_the_product_to_bf16_rounding(n_out: int, n_in: int, bias: bool) -> None:
    x, w, b = _case(n_out, n_in, bias)
    assert gemv.fits(x, w, b)
    y = gemv.gemv(x, w, b)
    ref = _reference(x, w, b)
    assert y.shape == (1, n_out) and y.dtype == torch.bfloat16
    # one bf16 rounding apart at most (the fp32 sums' order moves the last bit now and then)
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-3)
    assert ((y.float() - ref.float()).abs() <= ulp).all()
    # most entries are the correctly rounded product itself
    assert (y == ref).float().mean() > 0.9


def test_native_gemv_writes_into_out_and_rows_past_whole_blocks() -> None:
    x, w, b = _case(4 * 9 + 3, 64, True)  # 3 rows past the 4-row blocks
    out = torch.full((1, w.shape[0]), float("nan"), dtype=torch.bfloat16)
    assert gemv.gemv(x, w, b, out=out) is out
    assert torch.equal(out, gemv.gemv(x, w, b))
    assert not out.isnan().any()
    with pytest.raises(ValueError, match="contiguous bf16"):
        gemv.gemv(x, w, b, out=torch.empty(1, w.shape[0], dtype=torch.float32))


def test_native_gemv_gives_the_same_bits_on_any_thread_count() -> None:
    x, w, _ = _case(3072, 576, False, seed=1)
    results: list[torch.Tensor] = []

    def on(threads: int) -> None:  # a fresh thread: OpenMP's team is per calling thread
        torch.set_num_threads(threads)
        results.append(gemv.gemv(x, w, None))

    for threads in (1, 2, 3):
        t = threading.Thread(target=on, args=(threads,))
        t.start()
        t.join()
    assert len(results) == 3
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_what_the_kernel_does_not_take_runs_on_atens_gemv() -> None:
    x, w, b = _case(40, 24, True)  # 24 wide: not whole chunks of 16
    assert not gemv.fits(x, w, b)
    assert torch.equal(gemv.gemv(x, w, b), packed.gemv_native(x, w, b))
    x32, w32 = x.float(), w.float()  # fp32: ATen's
    assert not gemv.fits(x32, w32, None)
    assert torch.equal(gemv.gemv(x32, w32, None), packed.gemv_native(x32, w32, None))
    x2 = torch.cat([x, x])  # two rows: not a GEMV
    assert not gemv.fits(x2, w, None)
    xs = torch.randn(1, 64).to(torch.bfloat16)[:, ::2]  # a strided row is refused too
    assert not gemv.fits(xs, _case(8, 32, False)[1], None)


def test_without_native_kernels_the_gemv_is_atens(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = _case(960, 576, True)
    monkeypatch.setattr(gemv, "kernel", lambda: None)
    assert torch.equal(gemv.gemv(x, w, b), packed.gemv_native(x, w, b))
