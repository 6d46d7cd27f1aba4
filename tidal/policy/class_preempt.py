"""Preemption between request classes inside an instance: a higher class evicts a lower one.

The rule, one for the live instance (`services/instance/policy_adapter.py`) and the simulator
(`tidal.sim.apply.evict_for_classes`), run at each step boundary before the policy plans the
step. Only online (SLO) requests of a priority above the lowest one running here count:

- the head of those waiting (the highest priority waiting: `tidal.policy.state.order_waiting`
  keeps the list so) needs the KV blocks of its whole prompt (or what it must prefill again)
  plus its first token;
- each of those running needs the blocks for the rest of its prompt plus a token while it
  prefills, and one block when it decodes and its last block is full.

When the free blocks fall short of that, the instance evicts: best-effort (offline) work first
(checkpointed first, then the latest arrivals, as the bus signal does), then the online work of
a priority below the lowest of the requests that counted, lowest priority first, then the latest
arrival, until the shortfall is covered. Offline victims holding a checkpoint are released, all
others are recomputed (`tidal.policy.preempt`, carried out by the one interpreter). Never an
equal or higher priority; nothing when what may go cannot cover the shortfall (a partial free
would serve nothing); and nothing when no lower SLO class runs here: then the policy's own
online-first rule alone decides about offline work, exactly as without classes (with one SLO
class this rule never fires).

The victims wait at the head of their own priority in the waiting list, behind the requests
they made room for, and resume as the policy plans them.
"""

from __future__ import annotations

from tidal.policy.preempt import Preemption, preemption_of, take_blocks, victim_order
from tidal.policy.state import InstanceState, Phase, ReqState

__all__ = ["class_preemption"]


def class_preemption(inst: InstanceState) -> Preemption | None:
    """The evictions the higher classes on `inst` need now, or None (see the module)."""
    # NOTE: runs before every step of every instance: one pass, no list, in the usual case
    # (one SLO class here) it ends at the first waiting request.
    lowest = highest = None
    for r in inst.running:
        if r.is_online and r.num_blocks and r.phase is Phase.RUNNING:
            p = r.priority
            if lowest is None or p < lowest:
                lowest = p
            if highest is None or p > highest:
                highest = p
    if lowest is None:
        return None
    wq = inst.waiting
    if highest == lowest and (not wq or wq[0].priority <= lowest):
        return None  # nothing here outranks the lowest class running
    running = [r for r in inst.running if r.phase is Phase.RUNNING]
    need = 0
    cut: int | None = None  # the lowest priority of the requests that need blocks
    for r in running:
        if r.is_online and r.priority > lowest and (n := _blocks_needed(inst, r)):
            need += n
            cut = r.priority if cut is None else min(cut, r.priority)
    for r in inst.waiting:  # highest priority first: stop where none outranks `lowest`
        if r.priority <= lowest:
            break
        if r.is_online:
            need += inst.blocks_for(r.prefill_target + 1) - r.num_blocks
            cut = r.priority if cut is None else min(cut, r.priority)
            break
    short = need - inst.num_free_blocks
    if cut is None or short <= 0:
        return None
    can_release = inst.ckpt_capacity_tokens > 0
    order = victim_order(inst, can_release, cut)
    if sum(r.num_blocks for r in order) < short:
        return None
    return preemption_of(take_blocks(order, short), can_release, swap=False)


def _blocks_needed(inst: InstanceState, r: ReqState) -> int:
    """Blocks running `r` needs for its next step: the rest of its prompt and its first token
    while it prefills, one when it decodes with its last block full."""
    if r.num_prefill_left:
        return max(0, inst.blocks_for(r.prefill_target + 1) - r.num_blocks)
    return 1 if r.num_computed_tokens >= r.num_blocks * inst.block_size else 0
