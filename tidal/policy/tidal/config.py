"""Tidal's combination config: every borrowed mechanism is one flag (ablations are one flag)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TidalConfig:
    """Switches of the `tidal` policy; OOCO's own knobs live in the `ooco` sub-section."""

    pull_migration: bool = True
    """OOCO §3.4.3 pull of offline decodes by strict instances (Alg. 1)."""
    gating: bool = True
    """OOCO §3.4.2 offline gating cost model on relaxed instances."""
    prefix_order: bool = True
    """HyGen App. A.2/A.3: offline dispatch order from the prefix trie + freshness."""
    utility_ratio: float = 0.9
    """HyGen App. A.3 u: chance to take the next offline request in trie order (else stalest)."""
    length_aware_routing: bool = True
    """TaiChi Alg. 2 over the relaxed instances for online prefill (TTFT-feasible, least queued)."""
    admission_control: bool = True
    """OmniServe §3.3.3: reject an online request whose prefill cannot meet its TTFT SLO."""
    cpu_offload: bool = True
    """OmniServe §3.3.5: offline decodes evicted for lack of KV decode on the CPU-attention
    workers instead of being swapped/recomputed; piggybacked per §3.3.6."""

    cpu_overflow: bool = True
    """OmniServe §3.3.5 on latency-strict instances: "BE decoding requests that cannot be
    scheduled on GPUs will be offloaded to CPUs for Attention computation" -- the offline decodes
    OOCO Alg. 2 left out go first; then, Tidal's own rule, a planned offline decode may move so
    its KV blocks go to offline prefill (OmniServe's order puts BE prefill before BE decode,
    §3.3.2), only while the strict instance's offline prefill waits for KV: on the CPU it makes
    a token every `num_layers` steps (one layer a step, §3.2.3), so moving it otherwise costs
    tokens and gains nothing. One per step, longest context first, while one CPU step over the
    offloaded set stays within the budget and its KV copy fits the step; token-wise layers are
    piggybacked (§3.3.6). Once nothing binds, offloaded decodes come back one a step (§3.3.5).
    Needs `cpu_offload` and CPU workers; without it the host CPUs only take KV-evicted decodes,
    which never happens while GPU KV is plentiful."""
    strict_offline_prefill: bool = True
    """HyGen §4.1 inside latency-strict instances: after OOCO Alg. 2 has picked the decodes,
    offline prefill chunks fill what is left of the step's latency budget (OOCO's strict
    instances only decode, so their steps run far below the TPOT SLO once every offline decode
    the relaxed pool produces fits; that idle budget is where Tidal's extra offline work goes)."""
    strict_prefill_budget: float = 0.8
    """Latency budget of a strict step that carries offline prefill, as a fraction of the TPOT
    SLO (HyGen's L of Alg. 2, with headroom for the online TPOT being a mean over tokens). It is
    wall time: live, divided by the instance's measured / predicted step time before the step
    model fills it (`tidal.policy.tidal.budget`)."""
    strict_tpot_target: float = 0.9
    """The step budget is also held to what each online request decoding there has left of its
    TPOT (`tidal.policy.tidal.budget`): its mean TPOT is kept within this fraction of its SLO,
    counting the time it spent before the strict instance's steps (the KV hand-off after its
    first token) as HyGen's profiler (§4.2) counts the gap between batch latency and TBT.
    Tolerance for what the step model does not see (token delivery, a late step)."""
    strict_kv_reserve: float = 0.2
    """Fraction of a strict instance's KV blocks kept free of new offline prefills, for online
    requests pushed after their prefill (OOCO §3.4.3 push)."""
    relaxed_step_s: float = 0.1
    """Longest offline step on a latency-relaxed instance, seconds (`tidal`'s own; it was 0.05, as
    `ooco`'s `offline_step_cap_s` was until 2026-11-29, 0.4 s since; an `ooco:` section may
    still set it). OOCO §3.2.1 does not restrict a relaxed step's time; each step pays the fixed
    per-step overhead (`tidal.policy.tidal.relaxed`), so a longer one spends less of the
    instance on it, up to the instance's chunk. Every such step stays preemptible (a cut chunk
    resumes from its layer, in the engines and the simulator), so an online prefill still waits
    at most a layer. 0.1 against 0.05, offline tok/s, simulated (`tidal sim max-offline`, first
    600 s): 4,272 -> 4,337 on configs/ooco.yaml (tuned on), 2,299 -> 2,312 with the arXiv
    offline mix and 6,109 -> 6,216 on configs/ooco-code.yaml (held out); 0.15 lost on the arXiv
    mix (docs/policies.md, "Closing `tidal`'s gap")."""
    relaxed_uncut_ttft: float = 0.0
    """An offline step on a relaxed instance lasting at most this fraction of the TTFT SLO is
    not cut at a layer boundary by an arriving online prefill (OOCO §3.4.1): the prefill waits
    for its end (at most 0.2 s at a 2 s TTFT SLO), and its work is kept. 0 keeps every such
    step preemptible (OOCO's rule), the default: the engines (and the simulator) keep a cut
    step's finished layers and resume it, so the uncut step buys little (simulated, alone:
    4,272 -> 4,315 offline tok/s on configs/ooco.yaml) and costs online TTFT; live, in the
    embedded config, it stopped every layer cut (docs/policies.md, "Closing `tidal`'s gap")."""
    relaxed_fill: bool = False
    """HyGen §4.1's hybrid batch on relaxed instances: an online prefill step that takes every
    online prompt waiting there is topped up with offline prefill chunks while it stays within
    `relaxed_step_s` and `relaxed_uncut_ttft` x TTFT (so the online prompts' TTFT grows by at
    most that); False runs online prefill alone (OOCO §3.4.1)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.utility_ratio <= 1.0:
            raise ValueError("utility_ratio must be in [0, 1]")
        if not 0.0 < self.strict_prefill_budget <= 1.0:
            raise ValueError("strict_prefill_budget must be in (0, 1] (fraction of TPOT SLO)")
        if not 0.0 < self.strict_tpot_target <= 1.0:
            raise ValueError("strict_tpot_target must be in (0, 1] (fraction of TPOT SLO)")
        if not 0.0 <= self.strict_kv_reserve < 1.0:
            raise ValueError("strict_kv_reserve must be in [0, 1)")
        if self.relaxed_step_s <= 0.0:
            raise ValueError("relaxed_step_s must be > 0 seconds")
        if not 0.0 <= self.relaxed_uncut_ttft < 1.0:
            raise ValueError("relaxed_uncut_ttft must be in [0, 1) (fraction of TTFT SLO)")
