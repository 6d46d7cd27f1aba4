"""The Llama-architecture decoder over a paged KV cache, run one layer at a time.

Supports RMSNorm, RoPE (default, linear, llama3, yarn), grouped-query attention, SwiGLU MLP, tied
or untied embeddings and optional QKV bias: Llama 2/3, Qwen2/2.5, SmolLM2. Q/K/V and gate/up are
fused into one matmul each. Attention is the one swappable function `attention.ATTENTION`
(signature of `attention.sdpa_paged_attention`), so a faster kernel can replace it.

Rows of a step are ordered by the layer they start at (0 for fresh work, > 0 for work resumed
after a layer-boundary preemption, OOCO §3.4.1): the rows active at layer i are then a prefix of
the batch, so a layer runs on `x[:n_i]` without gathering.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tidal.engine.torch import attention, cpu_caps, gemv, native, packed
from tidal.engine.torch.attention import ForwardBatch
from tidal.engine.torch.fast_decode import NativeDecode
from tidal.engine.torch.model_config import ModelConfig
from tidal.engine.torch.rope import rope_inv_freq
from tidal.engine.torch.small_rows import SmallRowWeights

if TYPE_CHECKING:
    from tidal.engine.torch.piggyback import Piggyback


@dataclass
class LayerWeights:
    in_norm: torch.Tensor  # (hidden,)
    post_norm: torch.Tensor  # (hidden,)
    # matrices are (out, in) as in HF, or (in, out) when LlamaModel.transposed
    qkv: torch.Tensor  # (q + 2kv, hidden)
    qkv_bias: torch.Tensor | None  # (q + 2kv,)
    o: torch.Tensor  # (hidden, q)
    gate_up: torch.Tensor  # (2 * inter, hidden)
    down: torch.Tensor  # (hidden, inter)

    def tensors(self) -> list[torch.Tensor]:
        ts = [self.in_norm, self.post_norm, self.qkv, self.o, self.gate_up, self.down]
        return ts + ([self.qkv_bias] if self.qkv_bias is not None else [])


class LlamaModel:
    """Weights plus the layer-wise forward; holds no KV (the engine owns the cache)."""

    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.device, self.dtype = device, dtype

        def get(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype)

        self.embed = get("model.embed_tokens.weight")  # (V, hidden)
        self.norm = get("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in state
        self.lm_head = self.embed if tied else get("lm_head.weight")  # (V, hidden)
        self.transposed, self.gemv_native = weight_layout(device, dtype)
        # a state saved by `fused_state()` already holds the fused, laid-out matrices
        fused = "tidal.transposed" in state
        if fused and bool(state["tidal.transposed"].item()) != self.transposed:
            raise ValueError("fused state was saved for another device's weight layout")

        def lw(*names: str, key: str = "") -> torch.Tensor:
            """Fused matrix of `names` stacked on the output dim, in this model's layout."""
            if fused:
                return get(key)
            ws = [get(n) for n in names]
            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            # NOTE: .t().contiguous() is a fast transpose kernel; cat of transposed views is 10x
            # slower (measured), and load time counts (< 2 s from the cache)
            return w.t().contiguous() if self.transposed else w

        # a second, transposed copy of the LM head for single-row logits on CPU
        self.lm_head_t: torch.Tensor | None = None
        if self.transposed:
            self.lm_head_t = get("tidal.lm_head_t") if fused else self.lm_head.t().contiguous()
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.attention_bias and fused:
                bias = get(f"tidal.{i}.qkv_bias")
            elif config.attention_bias:
                bias = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"])
            self.layers.append(
                LayerWeights(
                    in_norm=get(p + "input_layernorm.weight"),
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    qkv=lw(*(a + f"{x}_proj.weight" for x in "qkv"), key=f"tidal.{i}.qkv"),
                    qkv_bias=bias,
                    o=lw(a + "o_proj.weight", key=f"tidal.{i}.o"),
                    gate_up=lw(
                        p + "mlp.gate_proj.weight",
                        p + "mlp.up_proj.weight",
                        key=f"tidal.{i}.gate_up",
                    ),
                    down=lw(p + "mlp.down_proj.weight", key=f"tidal.{i}.down"),
                )
            )
        # bf16 copies for an fp32 model's small-row matmuls (`use_bf16_weights`)
        self.small: SmallRowWeights | None = None
        # oneDNN-packed copies for multi-row matmuls, by id of the plain weight (`packed`); none
        # where this CPU's oneDNN refuses the dtype (bf16 without AVX-512: `cpu_caps`), the
        # plain layout's matmul then
        self.packed_w: dict[int, torch.Tensor] = {}
        if cpu_caps.can_pack(device, dtype) and self.weight_bytes() <= packed.PACK_MAX_BYTES:
            mats = [w for lay in self.layers for w in (lay.qkv, lay.o, lay.gate_up, lay.down)]
            # packing takes (out, in): an fp32 model's (in, out) matrices go in as their .t()
            self.packed_w = {id(w): packed.pack(w.t() if self.transposed else w) for w in mats}
            self.packed_w[id(self.lm_head)] = packed.pack(self.lm_head)
        inv, self.rope_scale = rope_inv_freq(config)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * self.rope_scale).to(device=device, dtype=dtype)  # (P, D)
        # sin with rotate_half's sign folded in: rope(x) = x*cos + roll(x, D/2)*sin_rot
        sin = emb.sin() * self.rope_scale
        sin[:, : config.head_dim // 2] *= -1
        self.sin_rot = sin.to(device=device, dtype=dtype)
        self.scale = config.head_dim**-0.5
        # called as hook(layer, num_rows) after each layer; tests use it to inject a preemption
        self.layer_hook: Callable[[int, int], None] | None = None
        self._kv_of: torch.Tensor | None = None  # the KV pool `_kv_list` views
        # decode steps on native kernels (`fast_decode`), where they build and apply
        self.native_decode: NativeDecode | None = None
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
            lib = native.load()
            self.native_decode = NativeDecode(self, lib) if lib else None
        self._kv_list: list[tuple[torch.Tensor, torch.Tensor]] = []

    def use_bf16_weights(self, max_rows: int) -> bool:
        """Run this fp32 CPU model's matmuls of up to `max_rows` rows on bf16 copies of its
        matrices (`small_rows`), its decode steps of that many rows on the native kernels;
        False (nothing changed) for another dtype or device, or past `PACK_MAX_BYTES`."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or max_rows < 1:
            return False
        if self.weight_bytes() > packed.PACK_MAX_BYTES:
            return False
        mats = [w for lay in self.layers for w in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        biases = [lay.qkv_bias for lay in self.layers if lay.qkv_bias is not None]
        self.small = SmallRowWeights(mats, biases, self.lm_head, self.transposed, max_rows)
        if lib := native.load():
            self.native_decode = NativeDecode(self, lib)
        return True

    def fused_state(self) -> dict[str, torch.Tensor]:
        """Weights as this model holds them (fused, laid out), so a later load copies nothing."""
        out = {
            "tidal.transposed": torch.tensor([int(self.transposed)]),
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.norm,
        }
        if self.lm_head is not self.embed:
            out["lm_head.weight"] = self.lm_head
        if self.lm_head_t is not None:
            out["tidal.lm_head_t"] = self.lm_head_t
        for i, lay in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = lay.in_norm
            out[p + "post_attention_layernorm.weight"] = lay.post_norm
            out |= {f"tidal.{i}.qkv": lay.qkv, f"tidal.{i}.o": lay.o}
            out |= {f"tidal.{i}.gate_up": lay.gate_up, f"tidal.{i}.down": lay.down}
            if lay.qkv_bias is not None:
                out[f"tidal.{i}.qkv_bias"] = lay.qkv_bias
        return out

    def weight_bytes(self, with_lm_head: bool = True, rows: int = 0) -> int:
        """Bytes of weights one decode step (of `rows` rows, when given) reads: the bf16 copies
        where they serve that many rows (the embedding gather is negligible)."""
        small = self.small if self.small is not None and self.small.applies(rows) else None

        def nb(t: torch.Tensor) -> int:
            c = t if small is None else small.copy_of(t)
            return c.numel() * c.element_size()

        n = sum(nb(t) for lay in self.layers for t in lay.tensors()) + nb(self.norm)
        return n + (nb(self.lm_head) if with_lm_head else 0)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed.index_select(0, token_ids)  # (N, hidden)

    def forward_layers(
        self,
        batch: ForwardBatch | None,
        kv: torch.Tensor,
        should_stop: Callable[[], bool] | None = None,
        module_s: dict[str, float] | None = None,
        piggy: Piggyback | None = None,
    ) -> int:
        """Run every layer on `batch.hidden` in place; returns how many layers ran (all of them
        unless `should_stop()` turned true at a layer boundary). kv: (L, 2, slots, Hk, D).

        `piggy`: offloaded requests riding this step (OmniServe §3.2.2): at each layer their
        rows join the QKV matmul and, once their attention output is back from the worker, the
        o_proj and MLP matmuls (layer-wise batching); `batch` is None when they are alone."""
        if (
            self.native_decode is not None
            and batch is not None
            and piggy is None
            and module_s is None
            and self.layer_hook is None
            and self.native_decode.fits(batch)
        ):
            return self.native_decode.run(batch, self._kv_views(kv), should_stop)
        cfg = self.config
        H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = cfg.q_size, cfg.kv_size
        timed = module_s is not None
        sync = torch.cuda.synchronize if timed and self.device.type == "cuda" else _noop
        kv_views = self._kv_views(kv)
        if batch is not None:
            x = batch.hidden
            cos = self.cos.index_select(0, batch.positions).unsqueeze(1)  # (N, 1, D)
            sin = self.sin_rot.index_select(0, batch.positions).unsqueeze(1)
            first = batch.groups[0][0]
        else:
            first = len(self.layers)  # no rows of the step's own
        gi, cur_n, n = 0, -1, 0
        for li, lay in enumerate(self.layers):
            regular = li >= first
            if regular:
                assert batch is not None
                while gi + 1 < len(batch.groups) and batch.groups[gi + 1][0] <= li:
                    gi += 1
                _, n, meta = batch.groups[gi]
                if n != cur_n:  # the active rows' views, made once per group, not per layer
                    cur_n, N = n, x.shape[0]
                    xs, c, s = (x, cos, sin) if n == N else (x[:n], cos[:n], sin[:n])
                    slots = batch.slot_mapping if n == N else batch.slot_mapping[:n]
            pin = piggy.enter(li) if piggy is not None else None
            t0 = time.perf_counter() if timed else 0.0
            if regular or pin is not None:
                if pin is None:
                    hx, hc, hs = xs, c, s
                else:
                    px, ppos = pin
                    pc = self.cos.index_select(0, ppos).unsqueeze(1)
                    ps = self.sin_rot.index_select(0, ppos).unsqueeze(1)
                    hx, hc, hs = (
                        (torch.cat([xs, px]), torch.cat([c, pc]), torch.cat([s, ps]))
                        if regular
                        else (px, pc, ps)
                    )
                m = hx.shape[0]
                h = F.rms_norm(hx, (cfg.hidden_size,), lay.in_norm, cfg.rms_norm_eps)
                qkv = self._linear(h, lay.qkv, lay.qkv_bias)  # (m, q + 2kv)
                qk = qkv[:, : q_size + kv_size].view(m, H + Hk, D)
                qk = torch.addcmul(qk * hc, qk.roll(D // 2, -1), hs)  # RoPE: 3 ops, not 7
                v = qkv[:, q_size + kv_size :].view(m, Hk, D)
                if pin is not None:
                    assert piggy is not None  # q, k, v out first: the worker starts meanwhile
                    r0 = n if regular else 0
                    piggy.send(li, qk[r0:, :H], qk[r0:, H:], v[r0:], self.scale)
                if timed:
                    sync()
                    t1 = time.perf_counter()
                    _acc(module_s, "qkv", t1 - t0)
                    t0 = t1
            if regular:
                qkr, vr = (qk, v) if pin is None else (qk[:n], v[:n])
                k_cache, v_cache = kv_views[li]  # (slots, Hk, D)
                k_cache.index_copy_(0, slots, qkr[:, H:])
                v_cache.index_copy_(0, slots, vr)
                # the decode rows on the native decode's kernel where it runs: the same
                # rounding as a step of decodes alone (`NativeDecode.attention`)
                attn = (
                    attention.ATTENTION
                    if self.native_decode is None
                    else self.native_decode.attention
                )
                o = attn(qkr[:, :H], k_cache, v_cache, meta, self.scale)
                if timed:
                    sync()
                    t1 = time.perf_counter()
                    _acc(module_s, "attention", t1 - t0)
                    t0 = t1
            back = piggy.arrived(li) if piggy is not None else None
            if back is None and regular:
                xs += self._linear(o, lay.o)
                if timed:
                    sync()
                    t1 = time.perf_counter()
                    _acc(module_s, "o_proj", t1 - t0)
                    t0 = t1
                h = F.rms_norm(xs, (cfg.hidden_size,), lay.post_norm, cfg.rms_norm_eps)
                g, u = self._linear(h, lay.gate_up).chunk(2, dim=-1)
                xs += self._linear(F.silu(g) * u, lay.down)
            elif back is not None:
                assert piggy is not None
                bx, bo = back  # the residual store's rows whose attention output is back
                X = torch.cat([xs, bx]) if regular else bx.clone()
                X += self._linear(torch.cat([o, bo]) if regular else bo, lay.o)
                h = F.rms_norm(X, (cfg.hidden_size,), lay.post_norm, cfg.rms_norm_eps)
                g, u = self._linear(h, lay.gate_up).chunk(2, dim=-1)
                X += self._linear(F.silu(g) * u, lay.down)
                if regular:
                    xs.copy_(X[:n])
                piggy.advance(li, X[n:] if regular else X)
            if timed and regular:
                sync()
                _acc(module_s, "mlp", time.perf_counter() - t0)
            if self.layer_hook is not None and regular:
                self.layer_hook(li, n)
            if should_stop is not None and li + 1 < len(self.layers) and should_stop():
                return li + 1
        return len(self.layers)

    def _kv_views(self, kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(k, v) cache views per layer of `kv`, made once: two ops a layer saved each step."""
        if self._kv_of is not kv:
            self._kv_of = kv
            self._kv_list = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
        return self._kv_list

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, hidden) final-layer states -> (M, V) fp32 logits."""
        h = F.rms_norm(hidden, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        if self.small is not None and self.small.applies(h.shape[0]):
            return self.small.logits(h)
        if self.lm_head_t is not None and h.shape[0] == 1:
            return torch.mm(h, self.lm_head_t).float()
        # NOTE: not `_linear`: the LM head keeps HF's (V, hidden) layout in every dtype
        return linear(
            h, self.lm_head, None, False, self.gemv_native, self.packed_w.get(id(self.lm_head))
        ).float()

    def _linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.small is not None and self.small.applies(x.shape[0]):
            return self.small.linear(x.to(self.small.dtype), w, b).to(self.dtype)
        return linear(x, w, b, self.transposed, self.gemv_native, self.packed_w.get(id(w)))


def weight_layout(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    """(transposed, gemv_native) for weights of `dtype` on `device`.

    transposed: matrices stored (in, out). On CPU in fp32, x @ W^T with W^T stored (in, out)
    row-major runs GEMV up to 2x faster than F.linear (measured with MKL/oneDNN at one row);
    multi-row fp32 calls run on oneDNN-packed copies (`packed`), 1.3-2x faster than either
    plain layout from 8 to 128 rows with AVX-512 and AVX2 alike (measured on Zen 4, 1 thread,
    30 SmolLM2 layers' matrices: 8 rows 32 vs 57 F.linear vs 65 ms here; with oneDNN capped
    at AVX2 57-62 vs 59-66 vs 86-92 ms). bf16/fp16 keep HF's (out, in): oneDNN is as fast or
    faster on it, and ATen's native reduced-precision GEMV needs it. CUDA's GEMMs take either
    layout at full speed.

    gemv_native: one-row matmuls in bf16/fp16 on CPU skip oneDNN for ATen's own GEMV (fp32
    accumulation, vectorised), 2-3x faster at SmolLM2's sizes where oneDNN's per-call cost
    dominates (measured: 30 layers' weights, 1 thread, 9.6 vs 27.6 ms; LM head 2.4 vs 5.5 ms).
    At M > 1 ATen's fallback GEMM is far slower than oneDNN, so only one-row calls skip it.
    """
    cpu = device.type == "cpu"
    return cpu and dtype == torch.float32, cpu and dtype in (torch.bfloat16, torch.float16)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    transposed: bool,
    gemv_native: bool,
    packed_w: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (n, in) -> (n, out) with w laid out as `weight_layout` says; `packed_w`, w's
    oneDNN-packed copy (`tidal.engine.torch.packed`), serves the multi-row calls (any dtype)."""
    if packed_w is not None and x.shape[0] > 1:
        return packed.linear_packed(x, packed_w, b)
    if transposed:
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)
    if gemv_native and x.shape[0] == 1:
        return gemv.gemv(x, w, b)
    return F.linear(x, w, b)


def _acc(d: dict[str, float] | None, key: str, dt: float) -> None:
    assert d is not None
    d[key] = d.get(key, 0.0) + dt


def _noop() -> None:
    return None
