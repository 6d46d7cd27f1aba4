"""OOCO's roofline step-latency model (papers/ooco.md §3.3, Tables 2-4, Eq. 1).

Per transformer layer, on one of `tp` tensor-parallel GPUs:
- GEMMs (Table 3): FLOPs = 2·N·Din·Dout, bytes = d·(N·Din + Din·Dout + N·Dout), for the QKV,
  output, gate+up and down projections, N = tokens in the step; plus the LM head once per step on
  one token per sequence.
- fused attention (Table 3), prefill and decode separately: FLOPs = 4·D_h·S_q·S_kv,
  bytes = 2d·(S_q·D_h + S_kv·D_kv) (K and V read once; flash attention keeps scores on chip).
- TP communication: two all-reduces of N·hidden·d bytes per layer, ring cost 2(tp-1)/tp at B_c.
Each operator takes max(FLOPs/F, bytes/M) (Eq. 1); the step adds O_p (any prefill) or O_d.

Calibrated extensions for GEMMs, all off by default (params `tile_tokens`, `knee`, `gemm_eff`):
- tile quantisation (OmniServe §3.3.1, Fig. 8c): GEMM compute is charged for N rounded up to a
  multiple of `tile_tokens`, because a partly filled thread-block tile costs as much as a full one.
- `knee` k > 0 replaces Eq. 1's max(c, m) by (c^k + m^k)^(1/k): measured kernels near the ridge
  point are slower than either bound (compute and memory overlap imperfectly); k -> inf is Eq. 1.
- `gemm_eff`: per GEMM shape (Din, Dout on one GPU), the measured/modelled time ratio at the
  calibration token counts, interpolated in N. It captures cuBLAS's per-shape kernel choice (the
  steps of Fig. 8c) that no closed form predicts; shapes without a table use the plain roofline.
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field

from tidal.perf.api import BatchShape
from tidal.perf.catalog import HardwareSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class RooflineParams:
    """OOCO Table 4: achievable rates (not datasheet peaks), overheads, link bandwidth."""

    F_g: float  # FLOP/s achieved by GEMMs
    F_ap: float  # FLOP/s achieved by prefill attention
    F_ad: float  # FLOP/s achieved by decode attention
    M_g: float  # bytes/s achieved by GEMMs
    M_a: float  # bytes/s achieved by attention
    O_p: float  # s, static overhead of a step with prefill (CPU logic, launches)
    O_d: float  # s, static overhead of a decode-only step
    B_c: float  # bytes/s, effective bandwidth of the TP collectives
    O_k: float = 0.0  # s, launch cost of one GEMM kernel (fitted on per-kernel timings)
    tile_tokens: int = 1  # GEMM token-dim tile; 1 = no quantisation
    knee: float = 0.0  # GEMM p-norm exponent joining compute and memory time; 0 = Eq. 1's max
    # (Din, Dout, ((N, time multiplier), ...) sorted by N) per calibrated GEMM shape
    gemm_eff: tuple[tuple[float, float, tuple[tuple[float, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        for f in ("F_g", "F_ap", "F_ad", "M_g", "M_a", "B_c"):
            if not getattr(self, f) > 0:
                raise ValueError(f"RooflineParams.{f} must be > 0, got {getattr(self, f)}")
        for f in ("O_p", "O_d", "O_k"):
            if getattr(self, f) < 0:
                raise ValueError(f"RooflineParams.{f} must be >= 0, got {getattr(self, f)}")
        if self.tile_tokens < 1:
            raise ValueError(f"tile_tokens must be >= 1, got {self.tile_tokens}")
        if self.knee < 0:
            raise ValueError(f"knee must be >= 0 (0 = hard max), got {self.knee}")
        for _, _, knots in self.gemm_eff:
            xs = [k[0] for k in knots]
            if not knots or xs != sorted(xs) or any(k[1] <= 0 for k in knots):
                raise ValueError("gemm_eff knots must be non-empty, sorted by N, multipliers > 0")

    @classmethod
    def from_hardware(
        cls, hw: HardwareSpec, bytes_per_value: int = 2, eff: DefaultEfficiency | None = None
    ) -> RooflineParams:
        """Uncalibrated parameters: datasheet peaks times typical achievable fractions."""
        e = eff or DEFAULT_EFFICIENCY
        f = hw.flops(bytes_per_value)
        return cls(
            F_g=f * e.gemm_flops,
            F_ap=f * e.prefill_attn_flops,
            F_ad=f * e.decode_attn_flops,
            M_g=hw.mem_bw * e.gemm_bw,
            M_a=hw.mem_bw * e.attn_bw,
            O_p=e.O_p,
            O_d=e.O_d,
            B_c=hw.link_bw * e.link_bw,
        )


@dataclass(frozen=True, slots=True)
class DefaultEfficiency:
    """Achievable / datasheet fractions used before any calibration."""

    gemm_flops: float = 0.70
    prefill_attn_flops: float = 0.50
    decode_attn_flops: float = 0.10
    gemm_bw: float = 0.80
    attn_bw: float = 0.70
    link_bw: float = 0.70
    O_p: float = 4e-3
    O_d: float = 3e-3


DEFAULT_EFFICIENCY = DefaultEfficiency()


class Bottleneck(enum.StrEnum):
    """OOCO §3.3.3: which resource limits a step."""

    COMPUTE = "compute"
    BANDWIDTH = "bandwidth"
    CAPACITY = "capacity"


@dataclass(frozen=True, slots=True)
class StepAnalysis:
    step_s: float
    compute_bound_s: float  # time of operators whose FLOP term won Eq. 1's max
    memory_bound_s: float  # time of operators whose byte term won
    comm_s: float
    overhead_s: float
    flops: float  # whole step, one GPU
    bytes: float  # whole step, one GPU
    compute_util: float  # flops / (step_s * F_g): share of achievable GEMM FLOP/s
    mem_util: float  # bytes / (step_s * M_g)
    bottleneck: Bottleneck


@dataclass(frozen=True, slots=True)
class _Gemm:
    din: float
    dout: float


_GEMM_MEMO_MAX = 1 << 16  # token counts remembered per model (a few MB at most)


@dataclass
class RooflineModel:
    """A `StepModel`: `step_s(batch)` costs a handful of float operations."""

    model: ModelSpec
    params: RooflineParams
    tp: int = 1
    _c: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        m, p, tp, d = self.model, self.params, self.tp, float(self.model.bytes_per_value)
        self.gemms = layer_gemms(m, tp)
        # Per GEMM: a = compute s/token, b = traffic s/token, w = weight traffic s (Table 3).
        self._abw = tuple(
            (2 * g.din * g.dout / p.F_g, d * (g.din + g.dout) / p.M_g, d * g.din * g.dout / p.M_g)
            for g in self.gemms
        )
        q, kv, h = m.q_dim / tp, max(m.kv_dim / tp, m.head_dim), float(m.hidden)
        lm_out = m.vocab / tp
        self._c = (
            float(m.num_layers),
            4 * q / p.F_ap,  # prefill attn: s per (query, key) pair
            d * 2 * (q + kv) / p.M_a,  # prefill attn: s per prompt token (Q,O + K,V)
            4 * q / p.F_ad,  # decode attn: s per context token (FLOPs)
            d * 2 * kv / p.M_a,  # decode attn: s per context token (K,V read)
            d * 2 * q / p.M_a,  # decode attn: s per request (Q read, O write)
            (4 * (tp - 1) / tp) * h * d / p.B_c if tp > 1 else 0.0,  # comm: s per token/layer
            2 * h * lm_out / p.F_g,  # LM head: s per sequence (compute)
            d * (h + lm_out) / p.M_g,  # LM head: s per sequence (traffic)
            d * h * lm_out / p.M_g,  # LM head: weight traffic
            p.O_k,  # LM head launch (the layers' GEMM launches are in layer_gemm_s)
        )
        self._tile = p.tile_tokens
        self._knee = p.knee
        tables = {(round(din), round(dout)): knots for din, dout, knots in p.gemm_eff}
        # Per GEMM: (xs, ys) of its shape's table, or None.
        self._eff = tuple(
            (
                ([k[0] for k in tables[key]], [k[1] for k in tables[key]])
                if (key := (round(g.din), round(g.dout))) in tables
                else None
            )
            for g in self.gemms
        )
        self._any_eff = any(e is not None for e in self._eff)
        self._gemm_memo: dict[float, float] = {}

    def gemm_s(self, n: float) -> tuple[float, ...]:
        """Each GEMM's time on n tokens (one layer), launch included: the per-kernel view."""
        return tuple(self._one_gemm(i, n) for i in range(len(self.gemms)))

    def _one_gemm(self, i: int, n: float) -> float:
        a, b, w = self._abw[i]
        t = self._tile
        c = a * (-(-n // t) * t if t > 1 else n)
        mem = b * n + w
        k = self._knee
        if k > 0:
            hi = c if c > mem else mem
            x = hi * ((c / hi) ** k + (mem / hi) ** k) ** (1.0 / k)
        else:
            x = c if c > mem else mem
        x += self.params.O_k
        e = self._eff[i]
        return x * _interp(e[0], e[1], n) if e is not None else x

    def layer_gemm_s(self, n: float) -> float:
        """Time of one layer's GEMMs on n tokens, launches included. Memoised per token count:
        schedulers ask about the same few counts (chunk sizes, batch sizes) over and over."""
        hit = self._gemm_memo.get(n)
        if hit is None:
            hit = self._layer_gemm_s(n)
            if len(self._gemm_memo) < _GEMM_MEMO_MAX:
                self._gemm_memo[n] = hit
        return hit

    def clear_memo(self) -> None:
        """Forget remembered GEMM times (benchmarks of a cold decision)."""
        self._gemm_memo.clear()

    def _layer_gemm_s(self, n: float) -> float:
        if n <= 0:
            return 0.0
        t = self._tile
        nq = -(-n // t) * t if t > 1 else n
        s = 0.0
        if self._knee > 0 or self._any_eff:
            k, inv_k, ok = self._knee, 1.0 / self._knee if self._knee else 0.0, self.params.O_k
            for (a, b, w), e in zip(self._abw, self._eff, strict=True):
                c = a * nq
                mem = b * n + w
                if k > 0:
                    if c > mem:
                        x = c * (1.0 + (mem / c) ** k) ** inv_k
                    else:
                        x = mem * (1.0 + (c / mem) ** k) ** inv_k
                else:
                    x = c if c > mem else mem
                x += ok
                s += x * _interp(e[0], e[1], n) if e is not None else x
            return s
        for a, b, w in self._abw:
            c = a * nq
            mem = b * n + w
            s += c if c > mem else mem
        return s + len(self._abw) * self.params.O_k

    def step_s(self, batch: BatchShape) -> float:
        n = batch.num_prefill_tokens + batch.num_decode_reqs
        if n <= 0:
            return 0.0
        L, ap, mp, ad, md, mq, comm, lc, lb, lw, launch = self._c
        layer = self.layer_gemm_s(n) + comm * n
        if batch.num_prefill_tokens:
            x = ap * batch.prefill_attn_pairs
            y = mp * batch.num_prefill_tokens
            layer += x if x > y else y
        if batch.num_decode_reqs:
            x = ad * batch.decode_context_tokens
            y = md * batch.decode_context_tokens + mq * batch.num_decode_reqs
            layer += x if x > y else y
        seqs = batch.num_prefill_reqs + batch.num_decode_reqs
        x = lc * seqs
        y = lb * seqs + lw
        p = self.params
        over = p.O_p if batch.num_prefill_tokens else p.O_d
        return L * layer + (x if x > y else y) + launch + over

    def fixed_s(self, batch: BatchShape) -> float:
        """The part of `step_s(batch)` run once per step, not per layer: the LM head, its launch
        and the static overhead. The simulator charges it again to a step that resumes a chunk
        cut at a layer boundary (OOCO §3.4.1; `tidal.sim.resume`)."""
        if batch.num_prefill_tokens + batch.num_decode_reqs <= 0:
            return 0.0
        lc, lb, lw, launch = self._c[7:]
        seqs = batch.num_prefill_reqs + batch.num_decode_reqs
        x = lc * seqs
        y = lb * seqs + lw
        p = self.params
        return (x if x > y else y) + launch + (p.O_p if batch.num_prefill_tokens else p.O_d)

    def analyze(self, batch: BatchShape, kv_capacity_tokens: float = math.inf) -> StepAnalysis:
        """Step time with its compute/memory split, utilisation and §3.3.3 bottleneck."""
        m, p, tp, d = self.model, self.params, self.tp, float(self.model.bytes_per_value)
        L = m.num_layers
        n = batch.num_tokens
        comp = mem = flops = nbytes = 0.0
        ops: list[tuple[float, float, float, float]] = []  # (flops, bytes, F, M) per step
        for g in self.gemms:
            gb = d * (n * (g.din + g.dout) + g.din * g.dout) * L
            ops.append((2 * n * g.din * g.dout * L, gb, p.F_g, p.M_g))
        q, kv = m.q_dim / tp, max(m.kv_dim / tp, m.head_dim)
        if batch.num_prefill_tokens:
            pf = 4 * q * batch.prefill_attn_pairs * L
            pb = d * 2 * (q + kv) * batch.num_prefill_tokens * L
            ops.append((pf, pb, p.F_ap, p.M_a))
        if batch.num_decode_reqs:
            ctx = batch.decode_context_tokens
            db = d * 2 * (kv * ctx + q * batch.num_decode_reqs) * L
            ops.append((4 * q * ctx * L, db, p.F_ad, p.M_a))
        seqs = batch.num_prefill_reqs + batch.num_decode_reqs
        lm_out = m.vocab / tp
        lb = d * (seqs * (m.hidden + lm_out) + m.hidden * lm_out)
        ops.append((2 * seqs * m.hidden * lm_out, lb, p.F_g, p.M_g))
        for f, b, F, M in ops:
            flops += f
            nbytes += b
            if f / F >= b / M:
                comp += f / F
            else:
                mem += b / M
        total = self.step_s(batch)
        comm = self._c[6] * n * L
        overhead = total - comp - mem - comm if n else 0.0
        kv_used = batch.decode_context_tokens + batch.num_prefill_tokens
        if kv_used >= 0.95 * kv_capacity_tokens:
            neck = Bottleneck.CAPACITY
        else:
            neck = Bottleneck.COMPUTE if comp >= mem else Bottleneck.BANDWIDTH
        return StepAnalysis(
            step_s=total,
            compute_bound_s=comp,
            memory_bound_s=mem,
            comm_s=comm,
            overhead_s=overhead,
            flops=flops,
            bytes=nbytes,
            compute_util=flops / (total * p.F_g) if total > 0 else 0.0,
            mem_util=nbytes / (total * p.M_g) if total > 0 else 0.0,
            bottleneck=neck,
        )

    def bs_sat(self) -> int:
        """OOCO Alg. 1's compute-saturated decode batch size: the smallest N at which one
        layer's GEMM FLOP time reaches its weight + activation traffic time."""
        a = sum(x[0] for x in self._abw)
        b = sum(x[1] for x in self._abw)
        w = sum(x[2] for x in self._abw)
        if a <= b:
            return 1 << 30  # never compute-bound (e.g. a CPU with huge FLOP/s per byte)
        n = max(1, math.ceil(w / (a - b)))
        t = self._tile
        return -(-n // t) * t if t > 1 else n


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, flat beyond the end knots."""
    i = bisect.bisect_right(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def layer_gemms(m: ModelSpec, tp: int = 1) -> tuple[_Gemm, ...]:
    """One layer's projections on one of `tp` GPUs (Megatron column/row split)."""
    mlp_out = (2 if m.gated_mlp else 1) * m.intermediate
    return (
        _Gemm(m.hidden, (m.q_dim + 2 * m.kv_dim) / tp),  # QKV projection (column parallel)
        _Gemm(m.q_dim / tp, m.hidden),  # output projection (row parallel)
        _Gemm(m.hidden, mlp_out / tp),  # gate+up, fused
        _Gemm(m.intermediate / tp, m.hidden),  # down projection
    )
