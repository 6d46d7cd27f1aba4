"""A worker's host KV store: capacity, attention against a reference, and recall mid-token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.cpu_attn.kv_store import KvStore, StoreFull
from tidal.cpu_attn.layer_timer import LayerTimer

L, Hk, G, D = 3, 2, 2, 8
H = Hk * G


def kv(T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, T, Hk, D, generator=g)


def test_attention_appends_and_matches_sdpa_over_the_whole_context() -> None:
    st = KvStore(1 << 20)
    ctx = kv(5)
    st.put("a", ctx, reserve_tokens=4)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, H + 2 * Hk, D, generator=g)
    out, errors = st.attend(1, ["a"], [5], qkv, H, D**-0.5)
    assert errors == {}
    k = torch.cat([ctx[1, 0], qkv[:, H : H + Hk]])  # (6, Hk, D)
    v = torch.cat([ctx[1, 1], qkv[:, H + Hk :]])
    ref = F.scaled_dot_product_attention(
        qkv[:, :H].transpose(0, 1).unsqueeze(0),  # (1, H, 1, D)
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        enable_gqa=True,
    )
    torch.testing.assert_close(out.view(H, D), ref[0, :, 0], rtol=1e-5, atol=1e-5)


def test_wrong_position_unknown_request_and_used_up_reserve_are_row_errors() -> None:
    st = KvStore(1 << 20)
    st.put("a", kv(2), reserve_tokens=1)
    qkv = torch.zeros(2, H + 2 * Hk, D)
    out, errors = st.attend(0, ["a", "zz"], [7, 0], qkv, H, 1.0)
    assert "position 7" in errors["a"] and "not offloaded" in errors["zz"]
    assert not out.any()  # rows not computed are zero
    _, errors = st.attend(0, ["a"], [2], qkv[:1], H, 1.0)
    assert errors == {}
    _, errors = st.attend(0, ["a"], [3], qkv[:1], H, 1.0)  # 2 + 1 reserved: no room for a 4th
    assert "reserve" in errors["a"]


def test_capacity_is_a_bound_and_a_drop_frees_it() -> None:
    per_token = L * 2 * Hk * D * 4
    st = KvStore(10 * per_token)
    st.put("a", kv(4), reserve_tokens=4)
    with pytest.raises(StoreFull, match="MiB"):
        st.put("b", kv(2), reserve_tokens=1)
    assert st.stats().num_refused == 1
    with pytest.raises(ValueError, match="already"):
        st.put("a", kv(1), reserve_tokens=0)
    assert st.drop("a") and not st.drop("a")
    st.put("b", kv(2), reserve_tokens=1)
    assert st.stats().used_bytes == 3 * per_token


def test_recall_mid_token_returns_the_tokens_every_layer_holds() -> None:
    st = KvStore(1 << 20)
    ctx = kv(4)
    st.put("a", ctx, reserve_tokens=2)
    st.attend(0, ["a"], [4], torch.ones(1, H + 2 * Hk, D), H, 1.0)  # layer 0 of token 4 only
    back = st.get("a")
    assert back.shape == (L, 2, 4, Hk, D)
    torch.testing.assert_close(back, ctx)
    assert st.stats().kv_tokens == 4


def test_layer_timer_buckets_are_cumulative_ready() -> None:
    t = LayerTimer()
    for s in (5e-6, 3e-4, 2.0):
        t.observe(s)
    assert sum(t.counts) == 3 and t.counts[0] == 1 and t.counts[-1] == 1
