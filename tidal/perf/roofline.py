"""OOCO's roofline step-latency model (papers/ooco.md §3.3, Tables 2-4, Eq. 1).

Per transformer layer, on one of `tp` tensor-parallel GPUs:
- GEMMs (Table 3): FLOPs = 2·N·Din·Dout, bytes = d·(N·Din + Din·Dout + N·Dout), for the QKV,
  output, gate+up and down projections, N = tokens in the step; plus the LM head once per step on
  one token per sequence.
- fused attention (Table 3), prefill and decode separately: FLOPs = 4·D_h·S_q·S_kv,
  bytes = 2d·(S_q·D_h + S_kv·D_kv) (K and V read once; flash attention keeps scores on chip).
- TP communication: two all-reduces of N·hidden·d bytes per layer, ring cost 2(tp-1)/tp at B_c.
Each operator takes max(FLOPs/F, bytes/M) (Eq. 1); the step adds O_p (any prefill) or O_d.

Two calibrated extensions, both off by default (params `tile_tokens`, `gemm_eff`):
- tile quantisation (OmniServe §3.3.1, Fig. 8c): GEMM compute is charged for N rounded up to a
  multiple of `tile_tokens`, because a partly filled thread-block tile costs as much as a full one.
- `gemm_eff`: achieved/roofline GEMM-time ratio as a piecewise-linear function of N, fitted on
  measured kernels; it captures cuBLAS's per-shape kernel choice that no closed form predicts.
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
    gemm_eff: tuple[tuple[float, float], ...] = ()  # (N, time multiplier) knots, sorted by N

    def __post_init__(self) -> None:
        for f in ("F_g", "F_ap", "F_ad", "M_g", "M_a", "B_c"):
            if not getattr(self, f) > 0:
                raise ValueError(f"RooflineParams.{f} must be > 0, got {getattr(self, f)}")
        for f in ("O_p", "O_d", "O_k"):
            if getattr(self, f) < 0:
                raise ValueError(f"RooflineParams.{f} must be >= 0, got {getattr(self, f)}")
        if self.tile_tokens < 1:
            raise ValueError(f"tile_tokens must be >= 1, got {self.tile_tokens}")
        xs = [k[0] for k in self.gemm_eff]
        if xs != sorted(xs) or any(k[1] <= 0 for k in self.gemm_eff):
            raise ValueError("gemm_eff knots must be sorted by N with positive multipliers")

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
            len(self.gemms) * m.num_layers * p.O_k + p.O_k,  # launch cost of all GEMMs
        )
        self._tile = p.tile_tokens
        self._eff_x = [k[0] for k in p.gemm_eff]
        self._eff_y = [k[1] for k in p.gemm_eff]

    def gemm_scale(self, n: float) -> float:
        """`gemm_eff` multiplier at n tokens (piecewise linear, flat beyond the knots)."""
        xs, ys = self._eff_x, self._eff_y
        if not xs:
            return 1.0
        i = bisect.bisect_right(xs, n)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - x0) / (x1 - x0)

    def layer_gemm_s(self, n: float) -> float:
        """Time of one layer's GEMMs on n tokens, without launch cost."""
        if n <= 0:
            return 0.0
        t = self._tile
        nq = -(-n // t) * t if t > 1 else n
        s = 0.0
        for a, b, w in self._abw:
            c = a * nq
            mem = b * n + w
            s += c if c > mem else mem
        return s * self.gemm_scale(n) if self._eff_x else s

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


def layer_gemms(m: ModelSpec, tp: int = 1) -> tuple[_Gemm, ...]:
    """One layer's projections on one of `tp` GPUs (Megatron column/row split)."""
    mlp_out = (2 if m.gated_mlp else 1) * m.intermediate
    return (
        _Gemm(m.hidden, (m.q_dim + 2 * m.kv_dim) / tp),  # QKV projection (column parallel)
        _Gemm(m.q_dim / tp, m.hidden),  # output projection (row parallel)
        _Gemm(m.hidden, mlp_out / tp),  # gate+up, fused
        _Gemm(m.intermediate / tp, m.hidden),  # down projection
    )
