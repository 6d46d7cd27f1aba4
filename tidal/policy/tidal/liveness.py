"""Liveness of the `tidal` policy on small KV pools: a plan for an instance whose own plan came
out empty although requests hold all of its KV, so that no request is ever stranded.

OOCO's strict step (Alg. 2) decodes what fits and makes room only for requests pushed to it
(§3.4.1); its relaxed step makes room for online prefill only by evicting offline work. On a
pool of a few thousand tokens both can reach a state in which nothing moves and nothing will:

* a strict instance whose running decodes each need a new block for their next token, with no
  block free. OOCO evicts offline decodes only for pushes, so when the decodes themselves run
  out the step is empty, every step, and the requests pushed to it wait for ever too;
* a relaxed instance whose blocks are all held by online prompts part-way through their
  prefill (or one prompt longer than the whole pool), with no offline work to evict.

Before either, OOCO's push (§3.4.3) hands an online decode to a strict instance as soon as its
context fits there; on a small pool that fills the strict instance with decodes that cannot
all finish. `tidal` pushes one only where it can finish beside the online decodes already
there (`fits_to_finish`); the others wait on their relaxed instance, KV kept, and move in
arrival order as room appears (`TidalPolicy.place_decode` / `tick`). On a pool with room for
them all (ooco.yaml's) nothing changes.

When a pool is stuck all the same, the way out, cheapest first: an offline request holding
blocks gives them up (a decode is swapped to host memory, or with CPU attention decodes there,
as OOCO's own strict eviction does; a prefill is recomputed, it has no output to lose); only
when none is left does the newest online request of the lowest priority end with an error
(`StepPlan.abort_no_kv`, the plan contract's rule: a policy never evicts online work, so an
online request that nothing can free KV for ends, "out of KV memory", rather than waiting for
ever). A push waiting for room takes the blocks of offline work the same way. A request that
fits no pool (its prompt, or its context as it grows) ends too, before it holds the pool.
Requests waiting for a hand-off out of the instance (`Phase.TRANSFER_WAIT`) or moving
(`Phase.MIGRATING`) free their blocks once their target has room, so an instance holding any
waits for them instead. On a strict instance short of blocks for its online decodes to finish,
the one needing the fewest goes first (`keep_one_finishing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tidal.policy.base import StepPlan
from tidal.policy.state import InstanceState, Phase, ReqState


def _newest_lowest(reqs: Sequence[ReqState]) -> str:
    lowest = min(r.priority for r in reqs)
    return next(r for r in reversed(reqs) if r.priority == lowest).req_id


def _evict_offline(inst: InstanceState, offload: bool) -> StepPlan | None:
    """The newest offline request holding blocks gives them up; None when there is none."""
    held = [
        r for r in inst.running if r.phase is Phase.RUNNING and r.num_blocks and not r.is_online
    ]
    if not held:
        return None
    v = held[-1]
    if not v.is_decoding:
        return StepPlan(recompute=(v.req_id,))
    return StepPlan(offload=(v.req_id,)) if offload else StepPlan(swap_out=(v.req_id,))


def _others_will_free(inst: InstanceState) -> bool:
    """Blocks held by requests leaving the instance come back without a step of its own."""
    return any(r.phase in (Phase.TRANSFER_WAIT, Phase.MIGRATING) for r in inst.running)


def strict_unstick(inst: InstanceState, offload: bool = False) -> StepPlan | None:
    """For a strict instance whose plan is empty: a plan that frees KV when every running
    decode needs a new block for its next token and none is free; None when it is not stuck
    that way (it then waits for something else: a transfer, the CPU, its budget).
    `offload`: an offline decode moves to the CPU-attention workers instead of being swapped.
    A push waiting for more blocks than are free takes those of offline work too: OOCO evicts
    offline decodes for it (§3.4.1), and here an offline prefill (HyGen's, on a strict
    instance) holding them is recomputed."""
    if inst.pending_in:
        first = inst.pending_in[0]
        if inst.blocks_for(first.num_computed_tokens + 1) > inst.num_free_blocks:
            got = _evict_offline(inst, offload)
            if got is not None:
                return got
    if inst.num_free_blocks > 0 or _others_will_free(inst):
        return None
    run = [r for r in inst.running if r.phase is Phase.RUNNING]
    if not run:
        return None
    bs = inst.block_size
    if any(r.is_decoding and r.num_blocks * bs > r.num_computed_tokens for r in run):
        return None  # one of them still has room in its last block: it can move
    if alone := holds_whole_pool(inst):
        return StepPlan(abort_no_kv=alone)
    got = _evict_offline(inst, offload)
    if got is not None:
        return got
    return StepPlan(abort_no_kv=(_newest_lowest(run),))


def holds_whole_pool(inst: InstanceState) -> tuple[str, ...]:
    """A running request that holds every block of `inst` and needs one more for its next
    token: no eviction can make room for it (evicted, it comes back to the same full pool)."""
    bs = inst.block_size
    for r in inst.running:
        full = r.num_blocks >= inst.num_blocks and r.num_blocks * bs <= r.num_computed_tokens
        if r.phase is Phase.RUNNING and full:
            return (r.req_id,)
    return ()


def too_long(inst: InstanceState, reqs: Sequence[ReqState]) -> tuple[str, ...]:
    """Requests among `reqs` still to prefill whose context is longer than all of `inst`'s KV
    pool: no plan can ever prefill them there."""
    return tuple(
        r.req_id
        for r in reqs
        if r.num_prefill_left and inst.blocks_for(r.prefill_target + 1) > inst.num_blocks
    )


def offline_unstick(inst: InstanceState, plan: StepPlan) -> StepPlan:
    """A relaxed instance's offline step: offline prompts longer than the pool end (out of KV
    memory) instead of being prefilled up to a full pool and recomputed for ever, and so does
    a request the step would recompute when it alone holds the whole pool."""
    offline = [r for r in (*inst.running, *inst.waiting) if not r.is_online]
    offline = [r for r in offline if r.phase in (Phase.RUNNING, Phase.WAITING)]
    if gone := too_long(inst, offline):
        return StepPlan(abort_no_kv=gone)
    if plan.recompute and (alone := holds_whole_pool(inst)) and alone[0] in plan.recompute:
        return StepPlan(abort_no_kv=alone)
    return plan


def relaxed_unstick(inst: InstanceState, online: Sequence[ReqState]) -> StepPlan | None:
    """For a relaxed instance whose online prefill step is empty: when online prompts part-way
    through their prefill hold every block and nothing else will free one, the newest of them
    ends; None when it is not stuck. (A prompt longer than the whole pool ends before its
    first chunk, `too_long`.)"""
    if not online:
        return None
    if inst.num_free_blocks > 0 or _others_will_free(inst):
        return None
    held = [r for r in inst.running if r.phase is Phase.RUNNING and r.num_blocks]
    if not held or any(not r.is_online or r.is_decoding for r in held):
        return None  # offline work to evict (the OOCO step does), or a decode that will end
    return StepPlan(abort_no_kv=(_newest_lowest(held),))


def blocks_to_finish(inst: InstanceState, r: ReqState) -> int:
    """New blocks `r` takes before its last token (at most: its `max_output_tokens`)."""
    final = r.num_prompt_tokens + r.max_output_tokens
    return max(0, inst.blocks_for(final) - r.num_blocks)


def keep_one_finishing(inst: InstanceState, plan: StepPlan) -> StepPlan:
    """When the online decodes on a strict instance need more new blocks to finish than are
    free, the one that needs the fewest keeps what it needs: the others take a new block
    only from what is left beyond it, and wait a step (they keep their KV) otherwise. That one
    then finishes and frees its blocks for the rest, where letting every decode take a block
    as it comes fills the pool with requests none of which can finish (`strict_unstick` would
    then end one of them). A wait costs the waiting request a step of its TPOT; it happens
    only on a pool too small for the online decodes it holds. The plan may come out empty
    (every decode short of a block): the caller then frees one (`strict_unstick`)."""
    if not plan.decode or not inst.running:
        return plan
    online = [r for r in inst.running if r.is_online and r.phase is Phase.RUNNING and r.is_decoding]
    if not online:
        return plan
    needs = {r.req_id: blocks_to_finish(inst, r) for r in online}
    free = inst.num_free_blocks
    if sum(needs.values()) <= free:
        return plan
    first = min(online, key=lambda r: (needs[r.req_id], r.arrival_s))
    bs = inst.block_size

    def grows(r: ReqState) -> bool:
        return r.num_blocks * bs <= r.num_computed_tokens

    # It decodes even where the plan gave its block to another.
    keep: list[str] = [first.req_id] if not grows(first) or free > 0 else []
    left = free - needs[first.req_id]
    by_id = {r.req_id: r for r in inst.running}
    for rid in plan.decode:
        r = by_id[rid]
        if rid == first.req_id:
            continue
        if grows(r):
            if left <= 0:
                continue
            left -= 1
        keep.append(rid)
    # Offline prefill (all a strict step prefills) waits too: its chunks would take the blocks.
    return dataclasses.replace(plan, decode=tuple(keep), prefill={}, max_repeat=1)


def online_room(inst: InstanceState) -> int:
    """Blocks of a strict instance left for one more online decode to finish in: its free
    blocks and those offline work holds (evicted for pushes, OOCO §3.4.1), less what the
    pushes waiting for it take and what its online decodes still need to finish."""
    room = inst.num_free_blocks
    for r in inst.running:
        if r.phase is not Phase.RUNNING:
            continue
        if r.is_online:
            room -= blocks_to_finish(inst, r)
        else:
            room += r.num_blocks
    for r in inst.pending_in:
        room -= inst.blocks_for(r.num_prompt_tokens + r.max_output_tokens)
    return room


def fits_to_finish(inst: InstanceState, r: ReqState) -> bool:
    """May online decode `r` be pushed to strict instance `inst` now: it can finish there
    beside the online decodes it holds, or the instance has no online work at all (a
    request longer than the pool then ends there, `holds_whole_pool`)."""
    if inst.blocks_for(r.num_prompt_tokens + r.max_output_tokens) <= online_room(inst):
        return True
    busy = inst.pending_in or inst.num_incoming
    return not busy and not any(x.is_online for x in inst.running)
