"""The state a policy reads: requests, instances and the cluster, as plain mutable records.

The simulator (`tidal.sim`) or the live scheduler owns them and keeps them up to date; a policy
(`tidal.policy.base`) only *reads* them and answers with frozen decision objects. `ReqState` is
one request, `InstanceState` one serving instance (its queues, KV blocks and step model),
`CpuPoolState` a node's CPU-attention workers (OmniServe §3.2), `ClusterView` everything a
cluster-level decision may look at.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tidal.perf.api import StepModel
from tidal.schemas.enums import RequestClass

__all__ = [
    "ClusterView",
    "CpuAttnModel",
    "CpuPoolState",
    "InstanceRole",
    "InstanceState",
    "Phase",
    "ReqState",
    "RequestClass",
    "Slo",
    "order_waiting",
]


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets of an online request."""

    ttft_s: float  # time to first token, seconds
    tpot_s: float  # mean time per output token after the first, seconds

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO targets must be > 0, got ttft={self.ttft_s} tpot={self.tpot_s}")

    def of_request(self, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> Slo:
        """A request's targets: its own (milliseconds, as on the wire) where it gives them,
        else these defaults. The one rule the gateway, the scheduler and the instances share."""
        return Slo(
            ttft_slo_ms / 1e3 if ttft_slo_ms else self.ttft_s,
            tpot_slo_ms / 1e3 if tpot_slo_ms else self.tpot_s,
        )


class Phase(enum.StrEnum):
    """Where a request is in its life. The list it sits in on its instance follows from it."""

    HELD = "held"  # in the cluster queue (`ClusterView.held`), on no instance yet
    WAITING = "waiting"  # queued on an instance, no KV resident (new, or preempted: recompute)
    RUNNING = "running"  # KV on the GPU: prefilling (chunks left) or decoding
    TRANSFER_WAIT = "transfer_wait"  # prefill done, waiting for room on its decode instance
    MIGRATING = "migrating"  # KV in flight to another instance
    SWAPPED = "swapped"  # KV parked in host memory, not progressing
    OFFLOADED = "offloaded"  # KV in host memory, decoding with CPU-attention workers
    FINISHED = "finished"
    REJECTED = "rejected"  # refused by admission control


@dataclass(slots=True, eq=False)
class ReqState:
    """One request as the scheduler sees it. Owned and updated by the caller; policies read it."""

    req_id: str
    req_class: RequestClass
    arrival_s: float  # when it reached the cluster, seconds
    num_prompt_tokens: int
    max_output_tokens: int  # it finishes after this many tokens (NOTE: the simulator knows the
    # trace's true output length; policies that must not peek should use a predictor instead)
    slo: Slo | None = None  # online requests only
    prefix_key: tuple[int, ...] = ()  # prompt block hashes, for prefix-sharing policies (HyGen)
    phase: Phase = Phase.HELD
    instance_id: int | None = None  # instance holding it (queue or KV); None while held
    num_computed_tokens: int = 0  # tokens whose KV is resident (GPU or host) = context length
    num_output_tokens: int = 0  # tokens generated so far (the first comes with the prefill)
    num_blocks: int = 0  # GPU KV blocks it holds on its instance
    start_s: float | None = None  # when a step first computed any of it (queueing ends)
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    max_tbt_s: float = 0.0  # longest gap between two of its tokens so far, seconds
    queued_s: float = 0.0  # when it entered its current queue, seconds
    num_preemptions: int = 0
    num_migrations: int = 0
    num_checkpointed_tokens: int = 0  # tokens whose KV is checkpointed in host memory (whole
    # blocks; `StepPlan.checkpoint`); kept while it lives on its instance
    is_released: bool = False  # SWAPPED by `StepPlan.release`: its checkpoint is its KV
    priority: int = 0  # its request class's priority: higher is served first where a policy
    # picks among waiting work by it (`tidal.config.classes`; the held queue, docs/classes.md)
    class_name: str = ""  # its request class ("": the kind's name)
    slo_admission: bool = True  # the policy's admission control may refuse it for its SLO
    # (False: its class's `admission: queue`; it is routed, and may miss its SLO)
    # NOTE: a field, not a property: read for every request of every step.
    is_online: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_online = self.req_class is RequestClass.ONLINE

    @property
    def prefill_target(self) -> int:
        """Context to (re)build by prefill: the prompt, or after a recompute preemption the
        prompt plus all output but the last token (which the next decode step feeds)."""
        o = self.num_output_tokens
        return self.num_prompt_tokens + o - 1 if o else self.num_prompt_tokens

    @property
    def num_prefill_left(self) -> int:
        """Tokens still to prefill; 0 once the request decodes."""
        left = self.prefill_target - self.num_computed_tokens
        return left if left > 0 else 0

    @property
    def is_decoding(self) -> bool:
        """Prefill done and the first token out: each step now computes one token."""
        return self.num_output_tokens > 0 and self.num_computed_tokens >= self.prefill_target


class InstanceRole(enum.StrEnum):
    """What an instance is for. Policies read it; the simulator only enforces KV capacity."""

    AGGREGATED = "aggregated"  # prefill + decode (Sarathi-Serve chunked prefill)
    PREFILL = "prefill"  # P/D disaggregation (DistServe)
    DECODE = "decode"
    RELAXED = "relaxed"  # OOCO §3.2.1: online/offline prefill, offline decode
    STRICT = "strict"  # OOCO §3.2.2: online decode, offline decode under the TPOT SLO
    P_HEAVY = "p-heavy"  # TaiChi §3.1: large chunk
    D_HEAVY = "d-heavy"  # TaiChi §3.1: small chunk


class CpuAttnModel(Protocol):
    """Latency of decode attention on the CPU-attention workers (OmniServe §3.2)."""

    def attn_s(self, num_reqs: int, context_tokens: int, num_workers: int) -> float:
        """Seconds for one decode step's attention of `num_reqs` requests, all layers."""
        ...


@dataclass(slots=True, eq=False)
class CpuPoolState:
    """The host's CPU-attention workers, shared by the instances of a node."""

    num_workers: int
    model: CpuAttnModel
    busy_until_s: float = 0.0  # when the workers finish the attention already given to them
    host_kv_tokens: int = 0  # KV tokens parked in host memory (swapped + offloaded)
    host_kv_capacity_tokens: int = 0  # host memory for KV, tokens (0: unlimited); a plan
    # that swaps or offloads past it is rejected
    pending_tokens: int = 0  # host KV tokens the CPU decodes already given to the workers (by
    # any instance of the pool) add when their step ends; room a plan must leave for them. The
    # simulator keeps it; live the workers' free memory is the room and this stays 0


@dataclass(slots=True, eq=False)
class InstanceState:
    """One serving instance (one model replica, `tp` GPUs). Owned and updated by the caller."""

    instance_id: int
    role: InstanceRole
    chunk_size: int  # token budget of one step (prefill tokens + decodes), Sarathi-Serve style
    max_batch_reqs: int  # most requests in one step
    block_size: int  # tokens per KV block
    num_blocks: int  # GPU KV blocks in total
    num_free_blocks: int
    step_model: StepModel
    kv_bytes_per_token: float  # on one GPU of this instance
    pcie_bytes_per_s: float  # GPU <-> host copy bandwidth (swap, offload)
    cpu: CpuPoolState | None = None  # CPU-attention workers this instance may use
    num_layers: int = 32  # layer boundaries a `StepPlan.layer_cut` step can be cut at (1: the
    # engine cannot cut a step; a policy then never sets `layer_cut`)
    waiting: list[ReqState] = field(default_factory=list)  # highest priority first, FIFO within
    # a priority, preempted ones at the head of theirs (the caller keeps it so: `order_waiting`)
    running: list[ReqState] = field(default_factory=list)  # KV on GPU (prefilling or decoding)
    swapped: list[ReqState] = field(default_factory=list)
    offloaded: list[ReqState] = field(default_factory=list)
    pending_in: list[ReqState] = field(default_factory=list)  # prefilled elsewhere, placed
    # here by `place_decode`, waiting (KV held at the source) until this instance has room
    num_waiting_tokens: int = 0  # sum of `num_prefill_left` over `waiting` (kept by the caller)
    num_incoming: int = 0  # requests migrating here right now (blocks already reserved)
    busy_until_s: float = 0.0  # end of the step in flight
    ckpt_capacity_tokens: int = 0  # host memory for offline KV checkpoints, tokens (0: none:
    # `StepPlan.checkpoint`/`release` are refused)
    ckpt_tokens: int = 0  # KV tokens checkpointed in host memory now
    # Measured / predicted step time of this instance's recent steps, >= 1 (live: the instance
    # measures it, `tidal.perf.step_scale`; the simulator: 1, its steps are the model's own,
    # unless its instances share devices, `tidal.sim.sharing`, which measures it the same way).
    # A policy filling a step up to a latency bound divides the bound by it.
    step_time_scale: float = 1.0
    # What the instance half of a policy leaves for its cluster half (name -> value). It is the
    # only state the halves share: it travels in the instance's `InstanceReport`, and the
    # simulator passes it through the same report, so both halves can run in different processes.
    hints: dict[str, float] = field(default_factory=dict)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.offloaded)


@dataclass(slots=True, eq=False)
class ClusterView:
    """Everything a cluster-level decision may look at."""

    instances: Sequence[InstanceState]  # index == instance_id
    held: list[ReqState]  # requests the policy chose to hold (`RouteAction.HOLD`), FIFO
    link_bytes_per_s: float  # instance <-> instance KV transfer bandwidth
    link_latency_s: float = 0.0  # fixed cost of one transfer
    cpu: CpuPoolState | None = None

    def transfer_s(self, req: ReqState, src: InstanceState) -> float:
        """Time to move `req`'s KV from `src` to another instance."""
        nbytes = req.num_computed_tokens * src.kv_bytes_per_token
        return self.link_latency_s + nbytes / self.link_bytes_per_s


def order_waiting(waiting: list[ReqState], at: int | None = None) -> None:
    """Keep an instance's waiting list highest priority first (a stable sort: the caller's
    order, FIFO with preempted ones first, stays within a priority). Every policy that admits
    waiting work in list order so serves higher request classes first (docs/classes.md).

    `at`: the index of the one request just put in a list that was in order; it is sorted only
    if that request breaks the order (the usual case, one priority, costs two comparisons)."""
    n = len(waiting)
    if at is not None:
        p = waiting[at].priority
        if (at == 0 or waiting[at - 1].priority >= p) and (
            at == n - 1 or waiting[at + 1].priority <= p
        ):
            return
    elif all(waiting[i].priority >= waiting[i + 1].priority for i in range(n - 1)):
        return
    waiting.sort(key=_minus_priority)


def _minus_priority(r: ReqState) -> int:
    return -r.priority
