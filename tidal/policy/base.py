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

State is explicit and owned by the caller: `ReqState`, `InstanceState` and `ClusterView`
(`tidal.policy.state`) are plain mutable records the simulator (or live scheduler) keeps up to
date; a policy only *reads* them and answers with frozen decision objects. It may keep its own
bookkeeping (e.g. TaiChi's "flowed" set), keyed by `req_id`.

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
from typing import Any, TypeVar

from tidal.perf.api import BatchShape
from tidal.plan import PolicyError, StepPlan
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, ReqState, Slo

__all__ = [
    "BlockBudget",
    "ClusterActions",
    "Migration",
    "Policy",
    "PolicyContext",
    "PolicyError",
    "Route",
    "RouteAction",
    "StepPlan",
    "parse_params",
    "shape_of",
]


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
