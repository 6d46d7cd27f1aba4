"""Preemption asked for from outside an instance's own plan: the `tidal.inst.<id>.preempt` bus
signal (`CtlPreempt`) that a scheduler or an operator sends to free KV on one instance now.

Pure: `plan_preemption` reads the instance's `InstanceState` and returns a `Preemption`, a
`StepPlan` with eviction stages only (carried out by the one interpreter, `tidal.plan`) and what
each victim loses. Offline work may be preempted; online work only with `below_priority` and
only when its class's priority is below it (a higher class making room: the plan carries it as
`evict_below`, which the interpreter checks). How a victim goes:

- `release` when it holds a checkpoint and the instance keeps them (ConServe): its GPU blocks are
  freed at once with no copy; the tokens past its checkpoint are lost and prefilled again.
- `swap` when asked (`swap=True`) and the engine really swaps (not `swap_is_recompute`): its KV
  is copied to host memory, nothing lost. Only for policies that swap requests back in; offline
  victims only (an online one is recomputed).
- `recompute` otherwise: its KV is dropped, the prompt and output prefilled again.

Victims, when only a number of blocks is asked for: offline work first, checkpointed ones
first (they lose least), then the latest arrivals; then, with `below_priority`, online work of
a lower class, lowest priority first, then the latest arrivals; until the blocks are reached.
If the eligible work holds fewer, nothing is preempted (a partial free would not admit what it
is for).

`room_for_online` is the cluster's use of it (opt-in: `preempt_for_online` in the cluster config,
the live scheduler and the simulator alike): an online request that no instance has the KV
blocks free for goes to the instance whose offline work, and online work of a class below its
own, can make the room, which preempts it (`below_priority` = the request's priority).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidal.plan import StepPlan
from tidal.policy.state import ClusterView, InstanceState, Phase, ReqState

__all__ = [
    "PreemptRefused",
    "Preemption",
    "Victim",
    "evictable",
    "plan_preemption",
    "preemption_of",
    "room_for_online",
    "take_blocks",
    "victim_order",
]

RELEASE, SWAP, RECOMPUTE = "release", "swap", "recompute"


class PreemptRefused(ValueError):
    """Nothing can be preempted as asked; the message says why."""


@dataclass(frozen=True)
class Victim:
    req_id: str
    how: str  # RELEASE | SWAP | RECOMPUTE
    num_blocks: int  # GPU KV blocks it frees
    tokens_lost: int  # tokens whose KV goes and is computed again


@dataclass(frozen=True)
class Preemption:
    plan: StepPlan  # release / swap_out / recompute stages only
    victims: tuple[Victim, ...]

    @property
    def num_blocks(self) -> int:
        """GPU KV blocks the victims hold (what the plan frees)."""
        return sum(v.num_blocks for v in self.victims)


def plan_preemption(
    inst: InstanceState,
    *,
    req_ids: Sequence[str] = (),
    num_blocks: int = 0,
    can_release: bool = False,
    can_swap: bool = False,
    swap: bool = False,
    below_priority: int | None = None,
) -> Preemption:
    """The preemption of `req_ids` (running offline requests here, or online ones of a class
    below `below_priority`), or with none named of such victims holding at least `num_blocks`
    GPU blocks. `can_release`: the engine keeps checkpoints; `can_swap`: it really swaps.
    Raises `PreemptRefused`, changing nothing."""
    if req_ids:
        chosen = [_named(inst, rid, below_priority) for rid in dict.fromkeys(req_ids)]
    elif num_blocks > 0:
        chosen = _by_blocks(inst, num_blocks, can_release, below_priority)
    else:
        raise PreemptRefused("name req_ids, or num_blocks >= 1 to free")
    online = any(r.is_online for r in chosen)
    return preemption_of(chosen, can_release, can_swap and swap, below_priority if online else None)


def preemption_of(
    chosen: Sequence[ReqState], can_release: bool, swap: bool, evict_below: int | None = None
) -> Preemption:
    """The `Preemption` of `chosen` (`StepPlan.evict_below`: for a request on its way)."""
    # NOTE: an online victim is recomputed, never swapped: no policy swaps online work back in
    victims = tuple(_victim(r, can_release, swap and not r.is_online) for r in chosen)
    plan = StepPlan(
        release=tuple(v.req_id for v in victims if v.how == RELEASE),
        swap_out=tuple(v.req_id for v in victims if v.how == SWAP),
        recompute=tuple(v.req_id for v in victims if v.how == RECOMPUTE),
        evict_below=evict_below,
    )
    return Preemption(plan, victims)


def evictable(r: ReqState, below_priority: int | None) -> bool:
    """Whether a preemption may take `r`'s KV: offline work always, online work only of a
    class below `below_priority`."""
    return not r.is_online or (below_priority is not None and r.priority < below_priority)


def _named(inst: InstanceState, req_id: str, below_priority: int | None) -> ReqState:
    r = next((r for r in inst.running if r.req_id == req_id), None)
    if r is None:
        where = next(
            (name for name in ("waiting", "swapped", "offloaded") if _has(inst, name, req_id)),
            None,
        )
        if where is None:
            raise PreemptRefused(f"{req_id!r} is not on this instance")
        raise PreemptRefused(f"{req_id!r} holds no GPU KV here ({where})")
    if not evictable(r, below_priority):
        if below_priority is None:
            raise PreemptRefused(
                f"{req_id!r} is online: online work is never preempted (without below_priority)"
            )
        raise PreemptRefused(
            f"{req_id!r} is online with priority {r.priority}, not below {below_priority}"
        )
    if r.num_blocks <= 0:
        raise PreemptRefused(f"{req_id!r} holds no GPU KV blocks")
    return r


def _has(inst: InstanceState, name: str, req_id: str) -> bool:
    lst: list[ReqState] = getattr(inst, name)
    return any(r.req_id == req_id for r in lst)


def _by_blocks(
    inst: InstanceState, num_blocks: int, can_release: bool, below_priority: int | None
) -> list[ReqState]:
    order = victim_order(inst, can_release, below_priority)
    held = sum(r.num_blocks for r in order)
    if held < num_blocks:
        what = "offline work" if below_priority is None else f"work below priority {below_priority}"
        raise PreemptRefused(
            f"{what} here holds {held} KV blocks, fewer than the {num_blocks} asked for"
        )
    return take_blocks(order, num_blocks)


def victim_order(
    inst: InstanceState, can_release: bool, below_priority: int | None = None
) -> list[ReqState]:
    """The running requests a preemption may take, in the order it takes them: offline work
    first (checkpointed ones first, they lose least; then the latest arrivals), then online
    work of a class below `below_priority`, lowest priority first, then the latest arrivals."""
    running = [r for r in inst.running if r.phase is Phase.RUNNING and r.num_blocks > 0]
    offline = [r for r in running if not r.is_online]
    offline.sort(key=lambda r: (not (can_release and r.num_checkpointed_tokens > 0), -r.arrival_s))
    if below_priority is None:
        return offline
    lower = [r for r in running if r.is_online and r.priority < below_priority]
    lower.sort(key=lambda r: (r.priority, -r.arrival_s))
    return offline + lower


def take_blocks(order: Sequence[ReqState], num_blocks: int) -> list[ReqState]:
    """The head of `order` that holds at least `num_blocks` GPU blocks."""
    chosen: list[ReqState] = []
    freed = 0
    for r in order:
        if freed >= num_blocks:
            break
        chosen.append(r)
        freed += r.num_blocks
    return chosen


def _victim(r: ReqState, can_release: bool, swap: bool) -> Victim:
    if can_release and r.num_checkpointed_tokens > 0:
        lost = max(0, r.num_computed_tokens - r.num_checkpointed_tokens)
        return Victim(r.req_id, RELEASE, r.num_blocks, lost)
    if swap:
        return Victim(r.req_id, SWAP, r.num_blocks, 0)
    return Victim(r.req_id, RECOMPUTE, r.num_blocks, r.num_computed_tokens)


def room_for_online(
    req: ReqState, view: ClusterView, usable: Sequence[int]
) -> tuple[int, int] | None:
    """(slot, KV blocks to free there) so that online `req` can start at once, or None; the
    preemption there may take offline work and online work of a class below `req.priority`
    (send `below_priority=req.priority`).

    Conservative: only for an online request, only when none of the `usable` slots has the
    blocks free that its prompt (and the online prompts of its priority or higher already
    waiting there, which go first) need, and only where the work it may preempt there holds
    enough to make up the rest; of those, the slot where that work holds the most KV. The
    policy's own route stands otherwise."""
    if not req.is_online:
        return None
    best: tuple[int, int, int] | None = None  # (evictable blocks, slot, blocks to free)
    p = req.priority
    for i in usable:
        inst = view.instances[i]
        waiting = sum(
            r.num_prefill_left
            for r in inst.waiting
            if r.is_online and r.priority >= p and r is not req
        )
        need = inst.blocks_for(req.num_prompt_tokens + waiting + 1)  # + its first token
        short = need - inst.num_free_blocks
        if short <= 0:
            return None  # room somewhere: nothing to preempt
        held = sum(r.num_blocks for r in inst.running if evictable(r, p))
        if held >= short and (best is None or held > best[0]):
            best = (held, i, short)
    return None if best is None else (best[1], best[2])
