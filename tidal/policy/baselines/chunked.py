"""Sarathi-Serve style batch building (stall-free batching, chunked prefill), shared by the
baselines: decodes first, then partial prefills, then new requests, within a token budget.

With ``online_first`` the batch is built online-first and offline requests are the preemption
victims (HyGen's *Sarathi++* §6, OOCO's *online priority* §5.1.4); without it every request is
treated alike in arrival order (Sarathi-Serve; OOCO's *base P/D*).

With ``checkpoint`` (and an instance that has checkpoint memory, ConServe) every offline decode
has its newly full KV blocks checkpointed to host memory while the budget lasts, a victim with a
checkpoint is released (its GPU blocks freed at once) instead of recomputed, and a released
request comes back by ``swap_in``, prefilling only the tail its checkpoint lacked.
"""

from __future__ import annotations

from tidal.policy.base import BlockBudget, StepPlan
from tidal.policy.plan_builder import stuck_online
from tidal.policy.state import InstanceState, Phase, ReqState

MAX_REPEAT = 1024  # decode-only plans: let the simulator run them back to back


def _prefill_fit(bb: BlockBudget, r: ReqState, want: int, reserve: int) -> int:
    """Most of `want` prefill tokens whose KV fits in the budget, keeping `reserve` blocks."""
    room = (r.num_blocks + bb.free - reserve) * bb.block_size - r.num_computed_tokens
    n = min(want, room)
    if n > 0:
        bb.take(r, n)
        return n
    return 0


def chunked_plan(
    inst: InstanceState,
    *,
    prefill: bool = True,
    decode: bool = True,
    online_first: bool = False,
    offline_decode_cap: int | None = None,
    swap_victims: bool = False,
    admit_offline: bool = True,
    watermark: float = 0.01,
    checkpoint: bool = False,
) -> StepPlan:
    """One step for `inst`. `offline_decode_cap` caps the decode batch for offline requests
    (online decodes always go first); `swap_victims` swaps victims to host instead of dropping
    their KV; `watermark` is the fraction of blocks kept free when admitting new requests;
    `checkpoint` checkpoints offline decodes and releases victims that hold a checkpoint."""
    if stuck := stuck_online(inst):
        return StepPlan(abort_no_kv=stuck)
    bb = BlockBudget(inst)
    tokens, slots = inst.chunk_size, inst.max_batch_reqs
    reserve = int(watermark * inst.num_blocks)
    running = [r for r in inst.running if r.phase is Phase.RUNNING]
    if online_first:  # stable partition: keeps admission order within each class
        running = [r for r in running if r.is_online] + [r for r in running if not r.is_online]
    # Tidal's contract: only offline work is evicted; an online request without room waits.
    victims = [r for r in running if not r.is_online]  # lowest priority last
    dropped: set[str] = set()
    chosen: set[str] = set()
    dec: list[str] = []
    bs = inst.block_size
    for r in running if decode else ():
        o = r.num_output_tokens
        # NOTE: inlined `r.is_decoding` and `bb.take(r, 1)`: this loop runs for every request
        # of every step the simulator takes.
        if not o or r.num_computed_tokens < r.num_prompt_tokens + o - 1 or r.req_id in dropped:
            continue
        if slots <= 0 or tokens <= 0:
            break
        if not r.is_online and offline_decode_cap is not None and len(dec) >= offline_decode_cap:
            continue
        cost = -(-(r.num_computed_tokens + 1) // bs) - r.num_blocks
        ok = cost <= 0 or bb.take(r, 1)
        while not ok and victims:
            v = victims.pop()
            if v.req_id in dropped or v.req_id in chosen:
                continue
            if online_first and v.is_online and not r.is_online:
                victims.append(v)
                break  # never preempt online work for offline work
            dropped.add(v.req_id)
            bb.release(v)
            if v is r:
                break
            ok = bb.take(r, 1)
        if ok and r.req_id not in dropped:
            dec.append(r.req_id)
            chosen.add(r.req_id)
            slots -= 1
            tokens -= 1
    pre = [r for r in running if r.req_id in dropped]
    ckpt_on = checkpoint and inst.ckpt_capacity_tokens > 0
    release = tuple(r.req_id for r in pre if ckpt_on and r.num_checkpointed_tokens)
    evict = tuple(r.req_id for r in pre if r.req_id not in release)
    swap_out = evict if swap_victims else ()
    preempt = () if swap_victims else evict

    swap_in: list[str] = []
    pf: dict[str, int] = {}
    if decode and not dropped and not inst.pending_in:
        # NOTE: parked offline work comes back only beside the blocks the online prompts here
        # still need: else it takes them, the online prefill waits, and the next step evicts
        # it again (a release and a swap-in every step, the online request never served).
        online = _online_prefill_blocks(inst, running)
        for r in inst.swapped:
            left = r.num_prefill_left  # a released request: the tail its checkpoint lacked
            n = min(left, tokens)
            if slots <= 0 or tokens <= 0 or bb.cost(r, max(n, 1)) > bb.free - reserve - online:
                break
            if left and not bb.take(r, n):
                break
            if not left:
                bb.take(r, 1)
            swap_in.append(r.req_id)
            if left:
                pf[r.req_id] = n
            else:
                dec.append(r.req_id)
            slots -= 1
            tokens -= n if left else 1

    if prefill and not dropped:
        for r in running:
            if tokens <= 0 or slots <= 0:
                break
            if r.is_decoding or r.req_id in dropped:
                continue
            n = _prefill_fit(bb, r, min(r.num_prefill_left, tokens), 0)
            if n:
                pf[r.req_id] = n
                tokens -= n
                slots -= 1
        waiting = inst.waiting
        if online_first and any(not r.is_online for r in waiting[:1]):
            waiting = sorted(waiting, key=lambda r: not r.is_online)
        for r in waiting:
            if tokens <= 0 or slots <= 0:
                break
            if not r.is_online and not admit_offline:
                break
            n = _prefill_fit(bb, r, min(r.num_prefill_left, tokens), reserve)
            if not n:
                break  # FCFS: no skipping ahead of a request that does not fit
            pf[r.req_id] = n
            tokens -= n
            slots -= 1
    ckpt = _checkpoints(inst, running, set(dec)) if ckpt_on else ()
    repeat = MAX_REPEAT if dec and not pf and not pre and not swap_in else 1
    if ckpt_on and repeat > 1:  # checkpoint again at least once a block, so a release loses
        repeat = bs  # under two blocks of what an offline decode computed
    return StepPlan(
        prefill=pf,
        decode=tuple(dec),
        checkpoint=ckpt,
        recompute=preempt,
        release=release,
        swap_out=swap_out,
        swap_in=tuple(swap_in),
        max_repeat=repeat,
    )


def _online_prefill_blocks(inst: InstanceState, running: list[ReqState]) -> int:
    """Blocks the online prompts running or waiting here still need for their prefill."""
    need = 0
    for r in (*running, *inst.waiting):
        if r.is_online and r.num_prefill_left:
            need += max(0, inst.blocks_for(r.prefill_target) - r.num_blocks)
    return need


def _checkpoints(inst: InstanceState, running: list[ReqState], dec: set[str]) -> tuple[str, ...]:
    """Offline decodes of this step whose new full blocks fit the checkpoint budget, oldest
    first (ConServe: checkpoint incrementally while decoding)."""
    room = inst.ckpt_capacity_tokens - inst.ckpt_tokens
    bs = inst.block_size
    out: list[str] = []
    for r in running:
        if r.is_online or r.req_id not in dec:
            continue
        new = r.num_computed_tokens // bs * bs - r.num_checkpointed_tokens
        if 0 < new <= room:
            out.append(r.req_id)
            room -= new
    return tuple(out)
