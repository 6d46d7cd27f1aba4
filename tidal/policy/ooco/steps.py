"""OOCO's instance half: what a relaxed or a strict instance computes each step (papers/ooco.md).

* Latency-relaxed instances (§3.2.1): online prefill first and alone (offline work pauses — the
  preemption of §3.4.1: an offline prefill step is cut at a layer boundary and its chunk
  resumed; steps are capped by `offline_step_cap_s`); with no online prefill waiting, offline
  decodes plus gated offline prefill (§3.4.2).
* Latency-strict instances (§3.2.2): mix decoding selection each step (Alg. 2); room for pushed
  online requests is made by evicting offline decodes chosen by bottleneck (§3.4.1).

The cluster half (routing, gating, push/pull migration) is `tidal.policy.ooco.policy`; the two
share only `InstanceState.hints`, where a strict step with slack leaves the §3.4.3 pull trigger.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from tidal.perf.api import BatchShape
from tidal.policy.base import Policy, PolicyContext, StepPlan
from tidal.policy.baselines.chunked import chunked_plan
from tidal.policy.batch_shape import add_prefill, decode_shape
from tidal.policy.ooco.config import OocoConfig
from tidal.policy.ooco.eviction import choose_victims, is_compute_bound
from tidal.policy.ooco.mix_decode import DecodeCandidate, select_mix_decode
from tidal.policy.plan_builder import PlanBuilder, split_running
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState

OOCO_ROLES = (InstanceRole.RELAXED, InstanceRole.STRICT)
MIN_CAP_STEPS = 2.0  # an offline step may always last this many of the smallest steps

# Hints a strict instance's `schedule` leaves for `tick` (`InstanceState.hints`), the §3.4.3 pull
# trigger: PULL_SEQ counts the steps in which every decode fit (nothing swapped) with slack
# under the TPOT SLO; PULL_SHAPE + a `BatchShape` field name holds that field of the latest such
# step. `tick` pulls once per new count, as if the step had just asked for more work.
PULL_SEQ = "ooco.pull_seq"
PULL_SHAPE = "ooco.pull."
SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(BatchShape))


def ooco_roles(ctx: PolicyContext, cfg: OocoConfig) -> list[InstanceRole]:
    """Relaxed/strict role per instance (§3.2)."""
    roles = list(ctx.roles)
    ours = all(r in (InstanceRole.RELAXED, InstanceRole.STRICT) for r in roles)
    if cfg.num_relaxed < 0 and ours and InstanceRole.RELAXED in roles:
        return roles
    n_rel = (ctx.num_instances + 1) // 2 if cfg.num_relaxed < 0 else cfg.num_relaxed
    n_rel = max(1, min(n_rel, ctx.num_instances - 1)) if ctx.num_instances > 1 else 1
    return [InstanceRole.RELAXED if i < n_rel else InstanceRole.STRICT for i in range(len(roles))]


class OocoSteps(Policy):
    """OOCO's instance half: `schedule` on relaxed and strict instances (`OocoPolicy` adds the
    cluster half)."""

    def __init__(self, ctx: PolicyContext, cfg: OocoConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(ctx.seed)
        self.roles = ooco_roles(ctx, cfg)

    def role_of(self, inst: InstanceState) -> InstanceRole:
        """The instance's OOCO role now: the one it reports when relaxed or strict, else ours."""
        return inst.role if inst.role in OOCO_ROLES else self.roles[inst.instance_id]

    # ------------------------------------------------------------------ steps
    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        if self.cfg.stand_in and self.is_standing_in(inst):
            return chunked_plan(inst, online_first=True)
        if self.role_of(inst) is InstanceRole.STRICT:
            return self.schedule_strict(inst, now)
        return self.schedule_relaxed(inst, now)

    def is_standing_in(self, inst: InstanceState) -> bool:
        """Set to `aggregated` by the scheduler (roles heal), or a strict instance that still
        has online prefill work from that time (a strict step never prefills, §3.2.2)."""
        if inst.role is InstanceRole.AGGREGATED:
            return True
        return self.role_of(inst) is InstanceRole.STRICT and online_waiting_tokens(inst) > 0

    def schedule_relaxed(self, inst: InstanceState, now: float) -> StepPlan:
        dec, pre = split_running(inst)
        online = [r for r in pre if r.is_online]
        online += [r for r in inst.waiting if r.is_online]
        if online:
            return self.online_prefill_step(inst, online)
        return self.offline_step(inst, dec, pre)

    def online_prefill_step(self, inst: InstanceState, online: Sequence[ReqState]) -> StepPlan:
        """§3.4.1: online prefill preempts offline work; offline decodes simply pause."""
        b = PlanBuilder(inst)
        for r in online:
            if b.add_prefill(r) == 0:
                break
        if b.prefill:
            return StepPlan(prefill=b.prefill)
        # Out of KV: evict offline requests on this relaxed instance (victims by bottleneck).
        off = [
            DecodeCandidate(r.req_id, r.num_computed_tokens)
            for r in inst.running
            if not r.is_online and r.phase is Phase.RUNNING
        ]
        need = min(online[0].num_prefill_left, b.chunk_left) - b.budget.free * inst.block_size
        victims = choose_victims(need, off, compute_bound=False) or [c.req_id for c in off]
        return StepPlan(recompute=tuple(str(v) for v in victims))

    def offline_step(
        self, inst: InstanceState, dec: Sequence[ReqState], pre: Sequence[ReqState]
    ) -> StepPlan:
        """No online prefill waiting: offline decodes + gated offline prefill (§3.4.2)."""
        b = PlanBuilder(inst)
        for r in dec:
            if r.phase is not Phase.RUNNING or r.is_online:
                continue
            if len(b.decode) >= inst.max_batch_reqs or not b.add_decode(r):
                break
        # NOTE: never below a few of the instance's own smallest steps: on a machine whose fixed
        # step cost is over the cap (SmolLM2 on a CPU: ~50 ms) a cap alone admits no prefill at
        # all, and the offline requests queued here would wait forever.
        smallest = inst.step_model.step_s(add_prefill(decode_shape([]), 1, 0))
        cap = max(self.cfg.offline_step_cap_s, MIN_CAP_STEPS * smallest)
        for r in [*(x for x in pre if not x.is_online), *inst.waiting]:
            if b.add_prefill(r, bound_s=cap) == 0:
                break
        if b.prefill or b.decode:
            repeat = self.cfg.decode_repeat if not b.prefill else 1
            # §3.4.1: an online arrival cuts this offline-only step at its next layer boundary
            cut = bool(b.prefill) and inst.num_layers > 1
            return StepPlan(
                prefill=b.prefill, decode=tuple(b.decode), max_repeat=repeat, layer_cut=cut
            )
        stuck = [r for r in inst.running if r.phase is Phase.RUNNING and not r.is_online]
        return StepPlan(recompute=(stuck[-1].req_id,)) if stuck else StepPlan()

    def schedule_strict(self, inst: InstanceState, now: float) -> StepPlan:
        """OOCO Alg. 2 on a latency-strict instance, after making room for pushed requests."""
        cfg = self.cfg
        running = [r for r in inst.running if r.phase is Phase.RUNNING and r.is_decoding]
        swap_out: list[str] = []
        if inst.pending_in:
            need = sum(r.num_computed_tokens + 1 for r in inst.pending_in)
            need -= inst.num_free_blocks * inst.block_size
            if need > 0:
                off = [
                    DecodeCandidate(r.req_id, r.num_computed_tokens)
                    for r in running
                    if not r.is_online
                ]
                bound = is_compute_bound(len(running), cfg.saturation_batch_size)
                victims = choose_victims(need, off, bound) or [c.req_id for c in off]
                # NOTE: evicted offline decodes are swapped to host memory rather than
                # recomputed: a strict instance may not prefill (Table 1) and the interface
                # cannot send a waiting request back to a relaxed instance.
                swap_out = [str(v) for v in victims]
                gone = set(swap_out)
                running = [r for r in running if r.req_id not in gone]
        online = [DecodeCandidate(r.req_id, r.num_computed_tokens) for r in running if r.is_online]
        offline = [
            DecodeCandidate(r.req_id, r.num_computed_tokens) for r in running if not r.is_online
        ]
        sel = select_mix_decode(
            inst.step_model,
            online,
            offline,
            cfg.tpot_slo_s,
            cfg.num_random_probes,
            self.rng,
            cfg.overload_mode,
        )
        b = PlanBuilder(inst)
        for rs in swap_out:
            b.budget.free += next(r.num_blocks for r in inst.running if r.req_id == rs)
        by_id = {r.req_id: r for r in running}
        for rid in [*sel.online, *sel.offline]:
            b.add_decode(by_id[str(rid)])
        swap_in: list[str] = []
        all_in = len(b.decode) == len(running) and not inst.swapped and not swap_out
        if not swap_out and not inst.pending_in and len(b.decode) == len(running):
            # Swapped offline decodes come back when the step still has slack.
            for r in inst.swapped:
                if b.step_s() >= cfg.migration_margin * cfg.tpot_slo_s:
                    break
                if not b.budget.take(r, 1):
                    break
                swap_in.append(r.req_id)
        if all_in and not swap_in and b.step_s() < cfg.migration_margin * cfg.tpot_slo_s:
            hints = inst.hints
            hints[PULL_SEQ] = hints.get(PULL_SEQ, 0.0) + 1.0
            for f in SHAPE_FIELDS:
                hints[PULL_SHAPE + f] = float(getattr(b.shape, f))
        repeat = 1
        if b.decode and all_in and b.step_s() < 0.9 * cfg.tpot_slo_s:
            repeat = cfg.decode_repeat
        if not (b.decode or swap_out or swap_in):
            return StepPlan()
        return StepPlan(
            decode=tuple(b.decode),
            swap_out=tuple(swap_out),
            swap_in=tuple(swap_in),
            max_repeat=repeat if not (swap_out or swap_in) else 1,
        )


def online_waiting_tokens(inst: InstanceState) -> int:
    """Online prompt tokens still to prefill on `inst`, queued or part-way through."""
    n = 0
    for r in inst.waiting:
        if r.is_online:
            n += r.num_prefill_left
    for r in inst.running:
        if r.is_online and not r.is_decoding:
            n += r.num_prefill_left
    return n
