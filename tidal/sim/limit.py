"""The most offline work any schedule could add beside an online load: an upper bound from the
roofline step model, against which `tidal sim max-offline` reports each policy.

OOCO §5.2 measures a policy's *maximum effective offline throughput*; this module says how far
that figure is from what the hardware allows. The bound is a fluid (GPU-seconds) argument:

1. A linear floor under every step. For the roofline (OOCO §3.3, Eq. 1) each term of `step_s`
   is a max of affine functions of the batch aggregates, and max(x, y) >= x, max(x, y) >= y:
       step_s >= L * (g * n + comm * n + pre + dec) + lm * S + F
   n = tokens through the GEMMs, S = sequences, g = the GEMMs' FLOP time per token (Eq. 1's
   compute side; weight traffic dropped), pre = prefill attention (its FLOP side ap * pairs or
   its traffic side mp * prompt tokens: two floors, both kept), dec = decode attention (the
   larger of its FLOP and KV-read sides), lm = LM head per sequence, F = the per-step overhead
   (min(O_p, O_d) plus kernel launches). Calibrated GEMM multipliers below 1 scale g down.
2. The per-step overhead F is paid once per step, and a step holds at most K tokens of KV
   (K = the instance's KV capacity): every decoding request's context and every prefill
   chunk's new tokens are resident. So steps >= (context + prefill tokens) / K, and F costs at
   least F / K per context or prefill token. Any batch cap a policy sets only adds steps.
3. Summed over a request (prompt I, output O; the prefill yields the first token, decode step
   j attends I + j - 1 tokens): n = I + O - 1, S = O, pairs >= I (I + 1) / 2, context =
   (O - 1) I + (O - 1)(O - 2) / 2. Every step time is >= the sum of its requests' shares, so
   the GPU-seconds of N instances over the window T bound the total: N T >= online cost +
   offline cost. Instances that share D < N devices (CPU engines pinned to fewer cores than
   there are instances) have D T between them: a step model fitted to one engine alone on one
   core prices that core's seconds, and two engines on it take turns.
4. Online cost, a lower bound: only the online requests whose SLO deadline (arrival + TTFT +
   (O - 1) TPOT) falls inside the window must be served in it, and the `violation_pct` share
   of all online requests may fail: the most expensive of them are left out.
5. CPU-attention workers (OmniServe §3.2) can take decode attention off the GPU, at most as
   many context tokens as they can stream in T (workers x bytes/s x T / KV bytes per token):
   that many tokens' attention and step overhead is credited back; equally, at most all of it.
6. Offline tokens are counted as `summarize` counts them (generated inside the window) and
   priced at the offered offline mix: the mean request cost over the mean output length.
7. A second floor on the step count, from the SLO pace (`tidal.sim.pacing`). An online request
   that meets its SLO produces its O tokens in O distinct steps (the prefill's last chunk gives
   the first, each decode step one more; a request is in one step at a time), all ending
   inside [arrival, its deadline]. Steps may be shared and run on any instance, so all
   instances together run at least P steps, P = the fewest points such that each charged
   request's interval holds O of them (interval multi-cover; the greedy by right end is
   optimal). A schedule may fail the violation cap's share, and P counts what is left
   whichever requests fail: the larger of P(due) less the `forgiven` largest O (a request
   removed lowers P by at most its O) and a floor from request-disjoint chains of pairwise
   disjoint intervals, which `forgiven` failures cannot all cut (`tidal.sim.pacing`). Then
       N T >= online cost + offline cost (point 3 without the F / K terms) + F P,
   a second valid bound beside point 2's; the limit is the smaller of the two (a step count
   >= max(P, resident / K) gives exactly both). CPU workers credit only attention against it:
   offloading attention removes no paced step. Steps of instances that share a device each
   pay F on it, so D T still bounds their sum.

Assumptions, stated because the bound rests on them: the step model is the roofline (the
regression and module-wise fits have no closed floor: refused); a schedule serves offline
requests in the offered mix's proportions (one that chose only short-prompt, long-output
requests could beat it: the simulator's policies take offline work first come first served);
preemption, recompute, migration and swapping only add work; every prompt token is computed
(an engine whose prefix cache serves prompts from one another, as the torch engine's serves
prompts that are each other's prefixes, does less work than charged and can beat the bound); a
step gives a request at most one token (no speculative or multi-token decoding); arrival times,
TTFT and the TPOT SLO enter only through the deadlines of points 4 and 7 (each tighter use
could only lower what a schedule achieves). The figure is simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tidal.config.cluster import ClusterConfig
from tidal.perf.roofline import RooflineModel
from tidal.schemas.enums import RequestClass
from tidal.sim.pacing import forgiven_points
from tidal.workload.mix import SimRequest


@dataclass(frozen=True, slots=True)
class LinearFloor:
    """Coefficients of the linear floor under one roofline step (seconds per unit)."""

    num_layers: int
    per_token_s: float  # per GEMM token, one layer: g + comm
    prefill_pair_s: float  # per prefill (query, key) pair, one layer: attention FLOPs
    prefill_token_attn_s: float  # per prompt token, one layer: attention traffic
    decode_ctx_s: float  # per decode context token, one layer
    decode_req_s: float  # per decoding request, one layer (Q read, O write)
    per_seq_s: float  # per sequence in the step: LM head
    per_step_s: float  # per step: overhead and launches

    def step_floor_s(
        self,
        num_tokens: int,
        num_seqs: int,
        prefill_tokens: int,
        prefill_pairs: int,
        decode_reqs: int,
        decode_ctx: int,
        prefill_on_flops: bool,
    ) -> float:
        """The floor of one step's time (`prefill_on_flops` picks the prefill-attention side)."""
        pre = (
            self.prefill_pair_s * prefill_pairs
            if prefill_on_flops
            else self.prefill_token_attn_s * prefill_tokens
        )
        dec = self.decode_ctx_s * decode_ctx + self.decode_req_s * decode_reqs
        layer = self.per_token_s * num_tokens + pre + dec
        return self.num_layers * layer + self.per_seq_s * num_seqs + self.per_step_s


def linear_floor(model: RooflineModel) -> LinearFloor:
    """The linear floor of `model.step_s` (module docstring, point 1)."""
    m, p, tp = model.model, model.params, model.tp
    d = float(m.bytes_per_value)
    e = min([1.0, *(k[1] for _, _, knots in p.gemm_eff for k in knots)])
    g = e * sum(2 * gm.din * gm.dout / p.F_g for gm in model.gemms)
    comm = (4 * (tp - 1) / tp) * m.hidden * d / p.B_c if tp > 1 else 0.0
    q, kv = m.q_dim / tp, max(m.kv_dim / tp, m.head_dim)
    ad, md, mq = 4 * q / p.F_ad, d * 2 * kv / p.M_a, d * 2 * q / p.M_a
    lm_out = m.vocab / tp
    lc, lb = 2 * m.hidden * lm_out / p.F_g, d * (m.hidden + lm_out) / p.M_g
    return LinearFloor(
        num_layers=m.num_layers,
        per_token_s=g + comm,
        prefill_pair_s=4 * q / p.F_ap,
        prefill_token_attn_s=d * 2 * (q + kv) / p.M_a,
        # max(ad C, md C + mq D) >= either side: keep the side with the larger C coefficient.
        decode_ctx_s=md if md >= ad else ad,
        decode_req_s=mq if md >= ad else 0.0,
        per_seq_s=max(lc, lb),
        per_step_s=e * len(model.gemms) * p.O_k * m.num_layers + p.O_k + min(p.O_p, p.O_d),
    )


@dataclass(frozen=True, slots=True)
class CpuAttnCapacity:
    """CPU-attention workers: how many context tokens of decode attention they can stream."""

    num_workers: int
    bytes_per_s_per_worker: float
    kv_bytes_per_token: float  # all layers, the whole model (all TP shards)


# What each `OfflineLimit.binding` names, in words: the limit's two step floors (points 2, 7).
BINDINGS = {"kv": "KV residency", "pacing": "the SLO pace"}


@dataclass(frozen=True, slots=True)
class OfflineLimit:
    """The bound for one config (simulated: derived from the step model, not measured)."""

    limit_tokens_per_s: float  # most offline tokens/s any schedule adds beside the online load
    offline_only_tokens_per_s: float  # the same with no online load: the instances' capacity
    gpu_s: float  # device-seconds in the window: min(N, D) x T (D: devices, default N)
    online_gpu_s: float  # lower bound on the GPU-seconds the online load needs in the window
    cpu_credit_s: float  # GPU-seconds of decode attention the CPU workers could take at most
    offline_s_per_token: float  # floor of GPU-seconds per offline output token, at the mix
    num_online: int  # online requests in the window
    num_online_charged: int  # of them, those charged (deadline in the window, not forgiven)
    num_offline: int  # offline requests of the mix
    kv_bound_tokens_per_s: float  # point 2's bound alone (steps >= resident tokens / K)
    pacing_bound_tokens_per_s: float | None  # point 7's alone (None: no step is paced)
    paced_steps: int  # P: the fewest steps the charged online requests' SLO pace forces
    paced_gpu_s: float  # F x P: their step overhead, GPU-seconds
    binding: str  # which bound the limit is: "kv" (point 2) or "pacing" (point 7)

    def share(self, tokens_per_s: float) -> float:
        """`tokens_per_s` as a fraction of the limit."""
        return tokens_per_s / self.limit_tokens_per_s if self.limit_tokens_per_s > 0 else 0.0


def _costs(
    f: LinearFloor,
    inp: np.ndarray,
    out: np.ndarray,
    kv_tokens: int | None,
    prefill_on_flops: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Per request: (floor GPU-seconds, the part CPU workers could take: decode attention plus
    its share of step overhead, F / `kv_tokens` per resident token: point 2's bound; None:
    none, point 7's). Point 3 of the module docstring."""
    per_resident_s = 0.0 if kv_tokens is None else f.per_step_s / kv_tokens
    dec = np.maximum(out - 1, 0)
    n = inp + dec
    pairs = inp * (inp + 1) / 2
    ctx = dec * inp + dec * (dec - 1) / 2
    pre = f.prefill_pair_s * pairs if prefill_on_flops else f.prefill_token_attn_s * inp
    # An offloaded decode still rides the GPU step as a row (its Q read and O write stay, as in
    # the simulator's step shape); its context's attention and KV residency leave the GPU.
    attn = (f.num_layers * f.decode_ctx_s + per_resident_s) * ctx
    cost = (
        f.num_layers * (f.per_token_s * n + pre + f.decode_req_s * dec)
        + f.per_seq_s * out
        + per_resident_s * inp
        + attn
    )
    return cost, attn


def _tokens(gpu_s: float, w: float, a: float, credit: float, kappa: float, alpha: float) -> float:
    """Offline tokens that fit in `gpu_s` beside online cost `w` (of it `a` offloadable), with
    `credit` GPU-seconds the CPU workers may take, at `kappa` s per token (`alpha` offloadable)."""
    x = max(gpu_s - w + credit, 0.0) / kappa
    if credit > 0:  # the workers take at most all decode attention
        x = min(x, max(gpu_s - (w - a), 0.0) / (kappa - alpha))
    return x


def offline_limit(
    model: RooflineModel,
    num_instances: int,
    kv_capacity_tokens: int,
    duration_s: float,
    online: Sequence[SimRequest],
    offline: Sequence[SimRequest],
    violation_pct: float = 0.0,
    cpu: CpuAttnCapacity | None = None,
    num_devices: int | None = None,
) -> OfflineLimit:
    """The most offline tokens/s any schedule adds beside `online` within `duration_s` on
    `num_instances` instances of `model` (module docstring). `offline` gives the length mix.
    `num_devices`: how many devices the instances share (None: each has its own)."""
    if not isinstance(model, RooflineModel):
        raise ValueError(
            f"the offline limit is derived from the roofline step model; got "
            f"{type(model).__name__} (set latency_model: roofline)"
        )
    if num_instances < 1 or kv_capacity_tokens < 1 or duration_s <= 0:
        raise ValueError("num_instances, kv_capacity_tokens and duration_s must be > 0")
    if num_devices is not None and num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if not 0 <= violation_pct <= 100:
        raise ValueError(f"violation_pct must be in [0, 100], got {violation_pct}")
    if not offline:
        raise ValueError("no offline requests: the offline length mix is empty")
    f = linear_floor(model)
    devices = num_instances if num_devices is None else min(num_instances, num_devices)
    gpu_s = devices * duration_s
    cpu_ctx = 0.0
    if cpu is not None and cpu.num_workers > 0:
        cpu_ctx = cpu.num_workers * cpu.bytes_per_s_per_worker * duration_s / cpu.kv_bytes_per_token
    off_in = np.array([r.input_tokens for r in offline], dtype=float)
    off_out = np.array([r.output_tokens for r in offline], dtype=float)
    due = [r for r in online if r.slo is None or _deadline(r) <= duration_s]
    forgiven = int(violation_pct / 100 * len(online))
    on_in = np.array([r.input_tokens for r in due], dtype=float)
    on_out = np.array([r.output_tokens for r in due], dtype=float)
    paced = [r for r in due if r.slo is not None]
    steps = forgiven_points([(r.arrival_s, _deadline(r), r.output_tokens) for r in paced], forgiven)
    # (bound, KV tokens a step holds, paced steps): point 2's; point 7's where steps are paced.
    bounds: list[tuple[str, int | None, int]] = [("kv", kv_capacity_tokens, 0)]
    if steps > 0:
        bounds.append(("pacing", None, steps))
    each: dict[str, tuple[float, float, float, float]] = {}
    only = float("inf")
    for name, kv, p in bounds:
        # GPU-seconds one CPU-streamed context token saves at most: its attention and, against
        # point 2's bound, its share of step overhead (no paced step leaves with it).
        per_res = 0.0 if kv is None else f.per_step_s / kv
        credit = (f.num_layers * f.decode_ctx_s + per_res) * cpu_ctx
        for flops_side in (True, False):
            on_cost, on_attn = _costs(f, on_in, on_out, kv, flops_side)
            keep = np.argsort(on_cost)[: max(len(due) - forgiven, 0)]
            w_on = float(on_cost[keep].sum()) + f.per_step_s * p
            a_on = float(on_attn[keep].sum())
            off_cost, off_attn = _costs(f, off_in, off_out, kv, flops_side)
            kappa = float(off_cost.sum() / off_out.sum())  # s per offline token at the mix
            alpha = float(off_attn.sum() / off_out.sum())  # of it, what CPU workers could take
            lim = _tokens(gpu_s, w_on, a_on, credit, kappa, alpha) / duration_s
            only = min(only, _tokens(gpu_s, 0.0, 0.0, credit, kappa, alpha) / duration_s)
            if name not in each or lim < each[name][0]:
                each[name] = (lim, w_on, credit, kappa)
    binding = min(each, key=lambda k: each[k][0])
    lim, w_on, credit, kappa = each[binding]
    return OfflineLimit(
        limit_tokens_per_s=lim,
        offline_only_tokens_per_s=only,
        gpu_s=gpu_s,
        online_gpu_s=w_on,
        cpu_credit_s=credit,
        offline_s_per_token=kappa,
        num_online=len(online),
        num_online_charged=max(len(due) - forgiven, 0),
        num_offline=len(offline),
        kv_bound_tokens_per_s=each["kv"][0],
        pacing_bound_tokens_per_s=each["pacing"][0] if "pacing" in each else None,
        paced_steps=steps,
        paced_gpu_s=f.per_step_s * steps,
        binding=binding,
    )


def _deadline(r: SimRequest) -> float:
    """When an online request's SLO has it finished: arrival + TTFT + (O - 1) TPOT."""
    assert r.slo is not None
    return r.arrival_s + r.slo.ttft_s + max(r.output_tokens - 1, 0) * r.slo.tpot_s


def config_limit(
    cfg: ClusterConfig,
    policy: str,
    violation_pct: float,
    offline_rate: float | None = None,
    num_devices: int | None = None,
) -> OfflineLimit:
    """`offline_limit` for `cfg`'s cluster as `policy` runs it (its own instance list if it has
    one), online trace and offline length mix (offered at `offline_rate` req/s if given), on
    `num_devices` devices shared by the instances (None: the config's `num_devices`, by default
    one each)."""
    from tidal.sim.build import _step_model, kv_geometry, with_offline_rate, workload

    if offline_rate is not None:
        cfg = with_offline_rate(cfg, offline_rate)
    if num_devices is None:
        num_devices = cfg.num_devices
    model = _step_model(cfg.model, cfg.hardware, cfg.tp, cfg.latency_model, cfg.profile)
    if not isinstance(model, RooflineModel):
        raise ValueError(
            f"the offline limit is derived from the roofline step model; {cfg.name} uses "
            f"latency_model: {cfg.latency_model}"
        )
    kvb, blocks = kv_geometry(cfg)
    reqs = workload(cfg)
    cw = cfg.cpu_workers
    cpu = CpuAttnCapacity(cw.count, cw.gb_per_s_per_worker * 1e9, kvb * cfg.tp)
    return offline_limit(
        model,
        sum(g.count for g in cfg.groups_for(policy)),
        blocks * cfg.block_size,
        cfg.duration_s,
        [r for r in reqs if r.req_class is RequestClass.ONLINE],
        [r for r in reqs if r.req_class is RequestClass.OFFLINE],
        violation_pct,
        cpu if cw.count > 0 else None,
        num_devices,
    )
