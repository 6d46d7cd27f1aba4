"""Why a plan was not carried out: one typed error with a reason from a closed set.

The live instance counts refusals by `reason` (`tidal_plan_refusals_total{reason=...}`); the
simulator raises them as `PlanRefused`, a `PolicyError`-like bug report about the policy.
"""

from __future__ import annotations

import enum

__all__ = ["PlanRefused", "PolicyError", "RefusalReason"]


class RefusalReason(enum.StrEnum):
    UNKNOWN_REQUEST = "unknown_request"  # names a request the instance does not hold
    WRONG_STATE = "wrong_state"  # e.g. swap_in of a running request, decode before prefill
    DUPLICATE = "duplicate"  # one request in two lists of one plan
    ONLINE_EVICTION = "online_eviction"  # recompute/swap_out/offload of an online request
    OUT_OF_KV = "out_of_kv"  # the plan's KV does not fit the free blocks
    HOST_MEMORY_FULL = "host_memory_full"  # swap/offload/checkpoint past the host's KV room
    NO_CPU_ATTENTION = "no_cpu_attention"  # offload/recall/cpu_decode on an engine without it
    CPU_WORKERS_BUSY = "cpu_workers_busy"  # CPU-attention workers refused or are still busy
    NO_LAYER_CUT = "no_layer_cut"  # layer_cut on an engine that cannot stop between layers
    NO_KV_CHECKPOINT = "no_kv_checkpoint"  # checkpoint/release on an engine that cannot
    BAD_CHUNK = "bad_chunk"  # a prefill of < 1 token, past the prompt, or cutting a forced chunk
    ENGINE_FAILURE = "engine_failure"  # the engine raised something else while carrying it out


class PolicyError(RuntimeError):
    """A decision the caller cannot carry out (a bug in the policy, not in the workload)."""


class PlanRefused(PolicyError):
    """A plan (or one stage of it) that was not carried out; nothing of it stays done."""

    def __init__(self, reason: RefusalReason, detail: str, stage: str = "") -> None:
        self.reason = reason
        self.detail = detail
        self.stage = stage  # the stage that failed ("" when refused before any ran)
        where = f" at {stage}" if stage else ""
        super().__init__(f"plan refused{where} ({reason}): {detail}")
