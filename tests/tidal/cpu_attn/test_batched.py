"""Batched decode attention equals one SDPA call per request, for mixed context lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.cpu_attn import batched
from tidal.cpu_attn.batched import attend_padded, groups_by_length
from tidal.cpu_attn.kv_store import KvStore

L, Hk, G, D = 2, 3, 3, 16
H = Hk * G
LENS = [1, 7, 30, 31, 64, 5, 200, 180]  # several length groups, one single-token row


def per_request_sdpa(ctx: torch.Tensor, qkv_row: torch.Tensor, scale: float) -> torch.Tensor:
    """The former per-row path: SDPA of the q heads over the context plus this token's k, v."""
    k = torch.cat([ctx[0], qkv_row[None, H : H + Hk]])  # (T + 1, Hk, D)
    v = torch.cat([ctx[1], qkv_row[None, H + Hk :]])
    q = qkv_row[:H].view(1, Hk, G, D)
    o = F.scaled_dot_product_attention(
        q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), scale=scale
    )
    return o.reshape(H * D)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_store_attention_of_mixed_lengths_equals_per_request_sdpa(
    dtype: torch.dtype, tol: float
) -> None:
    g = torch.Generator().manual_seed(0)
    st = KvStore(1 << 26)
    ctxs = {}
    for i, T in enumerate(LENS):
        ctxs[f"r{i}"] = torch.randn(L, 2, T, Hk, D, generator=g).to(dtype)
        st.put(f"r{i}", ctxs[f"r{i}"], reserve_tokens=2)
    ids = [*ctxs, "missing"]
    qkv = torch.randn(len(ids), H + 2 * Hk, D, generator=g).to(dtype)
    out, errors = st.attend(1, ids, [*LENS, 0], qkv, H, 0.3)
    assert errors == {"missing": "not offloaded to this worker"}
    assert not out[-1].any()
    for i, rid in enumerate(ctxs):
        ref = per_request_sdpa(ctxs[rid][1], qkv[i], 0.3)
        torch.testing.assert_close(out[i], ref, rtol=tol, atol=tol)


def test_padded_tails_never_leak_into_results() -> None:
    g = torch.Generator().manual_seed(2)
    batched._buffer(1 << 16, torch.float32).fill_(float("nan"))  # stale scratch at its worst
    long = torch.randn(2, Hk, 40, D, generator=g)
    short = torch.randn(2, Hk, 16, D, generator=g)  # capacity 16, 10 tokens written
    q = torch.randn(2, H, D, generator=g)
    o = attend_padded([long, short], [40, 10], q, 1.0)  # short row padded to 40
    assert torch.isfinite(o).all()
    ref = F.scaled_dot_product_attention(
        q[1].view(1, Hk, G, D), short[0, :, :10][None], short[1, :, :10][None], scale=1.0
    )
    torch.testing.assert_close(o[1], ref.reshape(H, D), rtol=1e-5, atol=1e-5)


def test_length_groups_bound_the_padding_and_bad_input_is_refused() -> None:
    groups = groups_by_length([100, 10, 90, 79, 11])
    assert sorted(i for grp in groups for i in grp) == [0, 1, 2, 3, 4]
    assert groups == [[0, 2], [3], [4, 1]]
    with pytest.raises(ValueError, match="min_fill"):
        groups_by_length([1], min_fill=0)
    with pytest.raises(ValueError, match="at least one token"):
        attend_padded([torch.zeros(2, Hk, 4, D)], [0], torch.zeros(1, H, D), 1.0)
