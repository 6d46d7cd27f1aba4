"""The policy interface: how a scheduling algorithm plugs into the simulator and the live services.

A *policy* is one object, chosen by name from `tidal.policy.registry`, that makes every scheduling
decision of a cluster. It is pure: no I/O, no clock, no randomness outside a seeded `random.Random`
it owns; `now` (seconds) is always passed in. The simulator (`tidal.sim`) and the live scheduler
call the same four methods:

================================  ===========================================================
``route(req, cluster, now)``      a request arrives: queue it on an instance, hold it in the
                                  cluster queue, or reject it (admission control) -> `Route`
``place_decode(req, inst, ...)``  a request's prefill just finished on `inst`: keep decoding
                                  there (None) or move it, KV included, to another instance
                                  (P/D disaggregation, OOCO push migration) -> `int | None`
``tick(cluster, now)``            after every step and arrival: dispatch held requests,
                                  migrate running ones, change roles or chunk sizes
                                  -> `ClusterActions`
``schedule(inst, now)``           an instance is about to run a step: what it computes
                                  (prefill chunks, decodes, CPU-attention decodes) and what
                                  it preempts, swaps or offloads first -> `StepPlan`
================================  ===========================================================

State is explicit and owned by the caller: `ReqState`, `InstanceState` and `ClusterView` are
plain mutable records the simulator (or live scheduler) keeps up to date; a policy only *reads*
them and answers with frozen decision objects. It may keep its own bookkeeping (e.g. TaiChi's
"flowed" set), keyed by `req_id`.

How to write a policy:

1. Subclass `Policy` (override only what you need; the defaults are route-to-least-loaded, decode
   where prefilled, no cluster actions). Compose small helpers (a router, a batch builder, a
   memory budget) rather than growing one class; `BlockBudget` and `shape_of` below are the
   shared arithmetic.
2. Give it a frozen dataclass config and a factory `(ctx: PolicyContext) -> Policy`; parse
   `ctx.params` (the policy's section of the YAML config) with `parse_params(MyConfig, ...)`.
3. Register the factory: ``@register_policy("my-name")`` from `tidal.policy.registry`, and add
   the module to `registry._POLICY_MODULES` so name lookup imports it.

What the simulator guarantees and checks (a violated check raises `PolicyError`):

* A `StepPlan` is applied in order: ``preempt`` (KV dropped, request back to the head of its
  instance's waiting queue, it recomputes prompt + generated tokens), ``swap_out`` and ``offload``
  (KV to host memory over PCIe), then ``swap_in`` and ``recall`` (back to the GPU), then blocks
  are allocated for ``prefill`` and ``decode``; if the instance lacks free blocks the plan is
  rejected. Use `BlockBudget` to build plans that fit.
* A request decodes only if named in ``decode`` (GPU attention) or ``cpu_decode`` (attention on
  the CPU-attention workers, its KV in host memory); a request may appear in one list only.
* Step time is ``inst.step_model.step_s(shape)`` for the GPU part, plus PCIe time for swaps and
  offloads. CPU-attention decodes run beside the step and emit their token at
  ``max(step end, start + cpu time)``; the workers stay busy until then, and a plan naming
  ``cpu_decode`` while ``inst.cpu.busy_until_s > now`` is rejected.
* An instance with work whose plan is empty idles until something happens (an arrival, a
  step end elsewhere, a transfer, the CPU workers freeing up, or ``next_tick_s``).
* KV moves: ``place_decode``'s target reserves blocks when the transfer starts; if it has no
  room the request waits (phase TRANSFER_WAIT, KV kept at the source, listed in the target's
  ``pending_in``) and is retried after every event. A `Migration` of a request that is in a
  step right now starts at that step's end; a migration to a full instance is refused and
  counted. Transfer time is `ClusterView.transfer_s`.
* Tokens are credited when a step (or span) ends: between those moments a request's counters
  are those of the step's start.
* ``preemptible_layers = L`` makes a one-step plan preemptible at layer granularity: when an
  online request is queued on (or lands at) the instance during the step, the step ends at the
  next multiple of ``step time / L`` after the arrival, nothing it computed is kept (chunks
  are recomputed, decodes retried), and the instance plans again (OOCO §3.4.1).
* ``max_repeat > 1`` on a decode-only plan lets the simulator run the same batch back to back
  without asking again until that many steps pass, a request finishes, memory runs short or
  anything arrives at the instance; it is only a speed hint and never changes what a policy
  that re-plans every step would decide, provided the policy's plan depends only on the
  instance's requests (not on elapsed time alone).
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tidal.perf.api import BatchShape, StepModel
from tidal.plan import PolicyError, StepPlan
from tidal.schemas.enums import RequestClass

__all__ = [
    "BlockBudget",
    "ClusterActions",
    "ClusterView",
    "CpuAttnModel",
    "CpuPoolState",
    "InstanceRole",
    "InstanceState",
    "Migration",
    "Phase",
    "Policy",
    "PolicyContext",
    "PolicyError",
    "ReqState",
    "RequestClass",
    "Route",
    "RouteAction",
    "Slo",
    "StepPlan",
    "parse_params",
    "shape_of",
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
    waiting: list[ReqState] = field(default_factory=list)  # FIFO; preempted ones at the head
    running: list[ReqState] = field(default_factory=list)  # KV on GPU (prefilling or decoding)
    swapped: list[ReqState] = field(default_factory=list)
    offloaded: list[ReqState] = field(default_factory=list)
    pending_in: list[ReqState] = field(default_factory=list)  # prefilled elsewhere, placed
    # here by `place_decode`, waiting (KV held at the source) until this instance has room
    num_waiting_tokens: int = 0  # sum of `num_prefill_left` over `waiting` (kept by the caller)
    num_incoming: int = 0  # requests migrating here right now (blocks already reserved)
    busy_until_s: float = 0.0  # end of the step in flight
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


class RouteAction(enum.Enum):
    QUEUE = "queue"  # put it in `instance_id`'s waiting queue
    HOLD = "hold"  # keep it in the cluster queue; `tick` dispatches it later
    REJECT = "reject"  # refuse it now (admission control); it never runs


@dataclass(frozen=True, slots=True)
class Route:
    """Where an arriving request goes. Build with `Route.to`, `Route.hold`, `Route.reject`."""

    action: RouteAction
    instance_id: int = 0  # target instance, meaningful for QUEUE only
    reason: str = ""  # why it was rejected or held, for the metrics

    @staticmethod
    def to(instance_id: int) -> Route:
        return Route(RouteAction.QUEUE, instance_id)

    @staticmethod
    def hold(reason: str = "") -> Route:
        return Route(RouteAction.HOLD, 0, reason)

    @staticmethod
    def reject(reason: str) -> Route:
        return Route(RouteAction.REJECT, 0, reason)


@dataclass(frozen=True, slots=True)
class Migration:
    """Move a running (decoding) request, KV included, to another instance."""

    req_id: str
    dst: int  # destination instance id; blocks are reserved there when the transfer starts


@dataclass(frozen=True, slots=True)
class ClusterActions:
    """What `Policy.tick` decided. Empty by default."""

    dispatch: Mapping[str, int] = field(default_factory=dict)  # held req_id -> instance id
    migrate: tuple[Migration, ...] = ()  # refused (and counted) if dst lacks free blocks
    set_role: Mapping[int, InstanceRole] = field(default_factory=dict)  # instance id -> role
    set_chunk_size: Mapping[int, int] = field(default_factory=dict)  # instance id -> tokens
    next_tick_s: float | None = None  # call tick again by this time even if nothing happens


NO_ACTIONS = ClusterActions()


def shape_of(prefill: Sequence[tuple[ReqState, int]], decode: Sequence[ReqState]) -> BatchShape:
    """The `BatchShape` of a step that prefills `(req, tokens)` chunks and decodes `decode`."""
    p_tok = p_pairs = p_sq = 0
    for req, n in prefill:
        p_tok += n
        p_pairs += n * (req.num_computed_tokens + n)
        p_sq += n * n
    ctx = 0
    for req in decode:
        ctx += req.num_computed_tokens
    return BatchShape(p_tok, len(prefill), p_pairs, len(decode), ctx, prefill_sq_tokens=p_sq)


class BlockBudget:
    """Free GPU KV blocks of an instance while a plan is being built (mirrors the simulator)."""

    __slots__ = ("block_size", "free")

    def __init__(self, inst: InstanceState) -> None:
        self.free = inst.num_free_blocks
        self.block_size = inst.block_size

    def cost(self, req: ReqState, new_tokens: int) -> int:
        """Extra blocks `req` needs to hold `new_tokens` more tokens of KV on the GPU."""
        held = req.num_blocks
        need = -(-(req.num_computed_tokens + new_tokens) // self.block_size)
        return need - held if need > held else 0

    def take(self, req: ReqState, new_tokens: int) -> bool:
        """Reserve the blocks for `new_tokens` more tokens if they fit; True if reserved."""
        c = self.cost(req, new_tokens)
        if c > self.free:
            return False
        self.free -= c
        return True

    def release(self, req: ReqState) -> None:
        """Count `req`'s blocks as free (it is preempted, swapped out or offloaded)."""
        self.free += req.num_blocks


@dataclass(frozen=True)
class PolicyContext:
    """What a policy factory receives: the static cluster and this policy's config section."""

    num_instances: int
    roles: tuple[InstanceRole, ...]  # initial role per instance
    online_slo: Slo
    params: Mapping[str, Any] = field(default_factory=dict)  # policy's own YAML section
    seed: int = 0


class Policy(ABC):
    """Base class of every scheduling policy; see the module docstring."""

    name: str = ""

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        """Default: the instance with the fewest queued prompt tokens."""
        best = min(cluster.instances, key=lambda i: (i.num_waiting_tokens, i.num_requests))
        return Route.to(best.instance_id)

    def place_decode(
        self, req: ReqState, inst: InstanceState, cluster: ClusterView, now: float
    ) -> int | None:
        """Default: decode where it was prefilled."""
        return None

    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        """Default: nothing to do at cluster level."""
        return NO_ACTIONS

    @abstractmethod
    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        """The next step of `inst` (called when it is idle and has work)."""


_C = TypeVar("_C")


def parse_params(cls: type[_C], params: Mapping[str, Any], where: str) -> _C:
    """Build the frozen config dataclass `cls` from a YAML mapping, naming unknown keys."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(params) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return cls(**params)
