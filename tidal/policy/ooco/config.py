"""OOCO's knobs (papers/ooco.md §3.2–3.4), one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OverloadMode = Literal["best-effort", "sacrifice"]


@dataclass(frozen=True)
class OocoConfig:
    """Configuration of OOCO's four scheduling points.

    Fields are in seconds and tokens; every range is checked in `__post_init__`.
    """

    tpot_slo_s: float = 0.1
    """TPOT SLO S of Alg. 1/2: the bound on one decode step of a latency-strict instance."""
    ttft_slo_s: float = 2.0
    """TTFT SLO of online requests (used by gating to price online prefill interference)."""
    num_random_probes: int = 8
    """K of Alg. 2: offline requests tried in random order before the sorted binary search."""
    saturation_batch_size: int = 256
    """bs_sat of Alg. 1: decode batch size at which GEMMs turn compute-bound (§3.3.3)."""
    migration_margin: float = 0.9
    """Alg. 1 line 2 'with some margin': pull only while L(B) < margin * S."""
    max_request_tokens: int = 32768
    """Upper end of the length-preference search in Alg. 1 (the model's context length)."""
    overload_mode: OverloadMode = "best-effort"
    """§3.4.4 last paragraph: when online decodes alone exceed S, decode them all anyway
    ("best-effort") or drop the longest online requests from this step until S holds
    ("sacrifice")."""
    num_layers: int = 28
    """Transformer layers: online prefill preempts offline work at a layer boundary (§3.4.1)."""
    gating_enabled: bool = True
    """§3.4.2: run the offline-prefill cost model; False admits offline prefill whenever KV fits."""
    gating_expected_output_tokens: int = 256
    """Expected decode tokens of an offline request, for the gating benefit when its output
    length is unknown."""
    num_relaxed: int = -1
    """Policy: how many instances (the first ones) are latency-relaxed; -1 keeps the roles of
    the cluster config (relaxed/strict), or half of them (rounded up) if it names neither."""
    offline_step_cap_s: float = 0.4
    """Policy: the longest offline step on a relaxed instance that offline prefill may fill
    (seconds, by the instance's step model). An online arrival cuts an offline prefill step at
    its next layer boundary (§3.4.1, in the simulator and the engines alike) and the chunk
    resumes later, so the cap does not bound an online prefill's wait; it sets how much offline
    prefill one step holds: a shorter cap pays the fixed per-step cost more often on the
    instance whose prefill binds, a longer one leaves more of a step to an online cut."""
    decode_repeat: int = 8
    """Policy: `max_repeat` of decode-only plans (a simulator speed hint)."""
    offline_buffer: int = 2
    """Policy: offline requests dispatched to a relaxed instance at a time (the rest are held
    in the cluster queue until gating admits them)."""
    stand_in: bool = True
    """Policy: roles heal (`tidal.cluster.healing`). An instance the scheduler sets to
    `aggregated` — standing in for a role no live instance has — prefills and decodes both
    classes, online first (Sarathi-Serve chunked prefill), and a strict instance left with
    online prefill work from its time as a stand-in finishes it; False keeps every instance to
    its OOCO role (online work for a lost role then waits for it)."""

    def __post_init__(self) -> None:
        if self.tpot_slo_s <= 0 or self.ttft_slo_s <= 0:
            raise ValueError("tpot_slo_s and ttft_slo_s must be > 0 seconds")
        if self.num_random_probes < 0:
            raise ValueError("num_random_probes (K of OOCO Alg. 2) must be >= 0")
        if self.saturation_batch_size < 1:
            raise ValueError("saturation_batch_size must be >= 1")
        if not 0 < self.migration_margin <= 1:
            raise ValueError("migration_margin must be in (0, 1]")
        if self.max_request_tokens < 1 or self.num_layers < 1:
            raise ValueError("max_request_tokens and num_layers must be >= 1")
        if self.overload_mode not in ("best-effort", "sacrifice"):
            raise ValueError("overload_mode must be 'best-effort' or 'sacrifice'")
        if self.offline_step_cap_s <= 0 or self.decode_repeat < 1 or self.offline_buffer < 1:
            raise ValueError("offline_step_cap_s > 0, decode_repeat >= 1, offline_buffer >= 1")
        if self.gating_expected_output_tokens < 1:
            raise ValueError("gating_expected_output_tokens must be >= 1")
