"""The `tidal` policy: OOCO's pools and migration as the skeleton, with HyGen's prefix-aware
offline order, TaiChi's length-aware routing, and OmniServe's admission control and
CPU-attention overflow for offline decodes. Every part is one flag of `TidalConfig`; OOCO's own
knobs (SLOs, K, bs_sat, step cap) come from the `ooco` sub-section of the params.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from tidal.policy.base import (
    ClusterActions,
    Migration,
    Policy,
    PolicyContext,
    Route,
    StepPlan,
    parse_params,
)
from tidal.policy.batch_shape import decode_shape
from tidal.policy.hygen.prefix_order import OfflineOrder
from tidal.policy.omniserve.config import OmniConfig
from tidal.policy.omniserve.control import oldest_first, piggyback_admission
from tidal.policy.omniserve.policy import ls_admissible
from tidal.policy.ooco.policy import OocoPolicy, ooco_config
from tidal.policy.plan_builder import PlanBuilder, parse_section
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, InstanceState, Phase, ReqState
from tidal.policy.taichi.policy import queued_prefill
from tidal.policy.taichi.routing import PrefillTarget, route_prefill
from tidal.policy.tidal.budget import strict_step_budget
from tidal.policy.tidal.config import TidalConfig
from tidal.policy.tidal.liveness import (
    fits_to_finish,
    keep_one_finishing,
    offline_unstick,
    relaxed_unstick,
    strict_unstick,
    too_long,
)
from tidal.policy.tidal.overflow import cpu_overflow_step, offline_prefill_candidates
from tidal.policy.tidal.relaxed import fill_online_step, keep_uncut

# A parked online decode's migration is asked for again this long after a refusal (seconds).
PARK_RETRY_S = 0.05


class TidalPolicy(OocoPolicy):
    def __init__(self, ctx: PolicyContext, cfg: TidalConfig, params: dict[str, object]) -> None:
        base = {"gating_enabled": cfg.gating, "offline_step_cap_s": cfg.relaxed_step_s}
        ocfg = ooco_config(ctx, {**base, **params})
        super().__init__(ctx, ocfg)
        self.tcfg = cfg
        self.omni = OmniConfig()
        self.order = OfflineOrder(cfg.prefix_order, cfg.utility_ratio, random.Random(ctx.seed))
        self._held: dict[str, ReqState] = {}
        # Online decodes parked on their relaxed instance until a strict one has room for them
        # to finish (`place_decode`): req_id -> when its migration was last asked for.
        self._parked: dict[str, float] = {}
        self._wake_s = 0.0  # the tick asked for while any is parked

    # ------------------------------------------------------------------ arrivals
    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        if not req.is_online:
            self.order.add(req.req_id, req.prefix_key, req.arrival_s)
            self._held[req.req_id] = req
            return Route.hold("offline: Tidal offline queue")
        route = super().route(req, cluster, now)
        if self.tcfg.admission_control and req.slo_admission:
            inst = cluster.instances[route.instance_id]
            ttft = req.slo.ttft_s if req.slo is not None else self.cfg.ttft_slo_s
            if not ls_admissible(inst, req, ttft, self.omni):
                return Route.reject("tidal: online prefill would miss its TTFT SLO")
        return route

    def pick_prefill_instance(self, req: ReqState, cluster: ClusterView, now: float) -> int:
        if not self.tcfg.length_aware_routing or len(self.relaxed) < 2:
            return super().pick_prefill_instance(req, cluster, now)
        insts = cluster.instances
        targets = [
            PrefillTarget(
                i,
                True,
                insts[i].chunk_size,
                queued_prefill(insts[i], online_only=True),
                decode_shape([]),  # offline work on relaxed instances yields to online (§3.4.1)
                insts[i].step_model,
            )
            for i in self.relaxed
        ]
        kv = req.num_prompt_tokens * insts[self.relaxed[0]].kv_bytes_per_token
        xfer = cluster.link_latency_s + kv / cluster.link_bytes_per_s
        got = route_prefill(req.num_prompt_tokens, targets, self.cfg.ttft_slo_s, xfer)
        return got if got is not None else super().pick_prefill_instance(req, cluster, now)

    def place_decode(
        self, req: ReqState, inst: InstanceState, cluster: ClusterView, now: float
    ) -> int | None:
        """OOCO's push (§3.4.3), to a strict instance where the request can finish beside the
        online decodes there (`fits_to_finish`); with none, or others parked before it, it
        stays on its relaxed instance, KV kept and not decoding, until `tick` moves it. A push
        that only needs room for its context would fill a small pool with decodes none of
        which can finish."""
        got = super().place_decode(req, inst, cluster, now)
        if got is None or not req.is_online:
            return got
        insts = cluster.instances
        if not self._parked and fits_to_finish(insts[got], req):
            return got
        if not self._parked:
            for i in self.strict:
                if fits_to_finish(insts[i], req):
                    return i
        self._parked[req.req_id] = -1.0
        return None

    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        acts = super().tick(cluster, now)
        if not self._parked:
            return acts
        moves = self._unpark(cluster, now)
        # Strict room goes to the parked online decodes first: no offline pull meanwhile; a
        # tick soon even if nothing happens (a refused migration is asked for again).
        if self._wake_s > now:  # one asked for already
            return dataclasses.replace(acts, migrate=moves)
        self._wake_s = now + PARK_RETRY_S
        return dataclasses.replace(acts, migrate=moves, next_tick_s=self._wake_s)

    def _unpark(self, cluster: ClusterView, now: float) -> tuple[Migration, ...]:
        """Parked online decodes, oldest first, to the strict instances they now fit."""
        where = {
            r.req_id: r for i in self.relaxed for r in cluster.instances[i].running if r.is_online
        }
        moves: list[Migration] = []
        used: set[int] = set()
        for rid in list(self._parked):
            r = where.get(rid)
            if r is None or r.phase is not Phase.RUNNING or not r.is_decoding:
                del self._parked[rid]  # moved (or ended)
                continue
            if now - self._parked[rid] < PARK_RETRY_S:
                break  # asked for: keep the order
            dst = next(
                (
                    i
                    for i in self.strict
                    if i not in used
                    and not cluster.instances[i].num_incoming
                    and fits_to_finish(cluster.instances[i], r)
                    and cluster.instances[i].blocks_for(r.num_computed_tokens + 1)
                    <= cluster.instances[i].num_free_blocks
                ),
                None,
            )
            if dst is None:
                break
            used.add(dst)
            self._parked[rid] = now
            moves.append(Migration(rid, dst))
        return tuple(moves)

    def dispatch_offline(self, cluster: ClusterView, now: float) -> dict[str, int]:
        """OOCO gating decides when; HyGen's prefix order decides which."""
        out: dict[str, int] = {}
        for i in self.relaxed:
            inst = cluster.instances[i]
            n_wait = sum(1 for r in inst.waiting if not r.is_online)
            while n_wait < self.cfg.offline_buffer and self._held:
                rid = self.order.pick()
                if rid is None:
                    break
                r = self._held[str(rid)]
                if not (self.admit_offline(inst, r) or self._starved(inst, r)):
                    break
                self.order.remove(rid)
                del self._held[str(rid)]
                out[r.req_id] = i
                n_wait += 1
        if self.tcfg.strict_offline_prefill:
            self._dispatch_strict(cluster, out)
        return out

    def _starved(self, inst: InstanceState, r: ReqState) -> bool:
        """An instance with no offline work takes the next offline request the gate refuses,
        when its prompt fits the free KV or can never fit the pool: the gate's reason (a bigger
        decode batch later, OOCO §3.4.2) is void with none, and a prompt that fits no pool is
        ended by the instance's step (out of KV memory) instead of blocking the queue."""
        if any(not x.is_online for x in (*inst.running, *inst.waiting)):
            return False
        need = inst.blocks_for(r.num_prompt_tokens + 1)
        return need <= inst.num_free_blocks or need > inst.num_blocks

    def _dispatch_strict(self, cluster: ClusterView, out: dict[str, int]) -> None:
        """Offline requests for the strict instances' prefill budget (HyGen's offline queue),
        while their KV stays above the reserve kept for pushed online requests."""
        for i in self.strict:
            inst = cluster.instances[i]
            n_wait = sum(1 for r in inst.waiting if not r.is_online)
            free = inst.num_free_blocks - int(self.tcfg.strict_kv_reserve * inst.num_blocks)
            while n_wait < self.cfg.offline_buffer and self._held:
                rid = self.order.pick()
                if rid is None:
                    break
                r = self._held[str(rid)]
                need = inst.blocks_for(r.num_prompt_tokens + self.cfg.gating_expected_output_tokens)
                if need > free:
                    break
                self.order.remove(rid)
                del self._held[str(rid)]
                out[r.req_id] = i
                free -= need
                n_wait += 1

    # ------------------------------------------------------------------ steps
    def _cpu(self, inst: InstanceState) -> bool:
        return self.tcfg.cpu_offload and inst.cpu is not None and inst.cpu.num_workers > 0

    def _cpu_batch(self, inst: InstanceState, plan: StepPlan, now: float, bound: float) -> StepPlan:
        """OmniServe §3.3.6: piggyback offloaded decodes whose CPU attention is due."""
        cpu = inst.cpu
        if cpu is None or not inst.offloaded or cpu.busy_until_s > now + 1e-12:
            return plan
        by_id = {r.req_id: r for r in inst.running}
        dec = [by_id[x] for x in plan.decode if x in by_id]
        shape = decode_shape([r.num_computed_tokens for r in dec])
        n = piggyback_admission(inst.step_model, shape, [len(inst.offloaded)], bound)[0]
        if n <= 0:
            return plan
        return dataclasses.replace(plan, cpu_decode=oldest_first(inst.offloaded, n))

    def online_prefill_step(self, inst: InstanceState, online: Sequence[ReqState]) -> StepPlan:
        if gone := too_long(inst, online):  # no pool takes them: end them before any chunk
            return StepPlan(abort_no_kv=gone)
        plan = super().online_prefill_step(inst, online)
        if plan.is_empty:  # out of KV with no offline work to evict (`tidal.policy.tidal.liveness`)
            return relaxed_unstick(inst, online) or plan
        if not self.tcfg.relaxed_fill:
            return plan
        bound = min(self.cfg.offline_step_cap_s, self.tcfg.relaxed_uncut_ttft * self.cfg.ttft_slo_s)
        return fill_online_step(inst, plan, online, bound)

    def offline_step(
        self, inst: InstanceState, dec: Sequence[ReqState], pre: Sequence[ReqState]
    ) -> StepPlan:
        plan = keep_uncut(
            inst,
            offline_unstick(inst, super().offline_step(inst, dec, pre)),
            self.cfg.ttft_slo_s,
            self.tcfg.relaxed_uncut_ttft,
        )
        if plan.abort_no_kv:
            return plan
        if not self._cpu(inst):
            return plan
        if plan.recompute:  # out of KV: decode the victim on the CPU instead of recomputing it
            by_id = {r.req_id: r for r in inst.running}
            off = tuple(x for x in plan.recompute if by_id[x].is_decoding)
            rest = tuple(x for x in plan.recompute if x not in off)
            return StepPlan(recompute=rest, offload=off)
        return self._cpu_batch(inst, plan, 0.0, self.cfg.offline_step_cap_s)

    def schedule_strict(self, inst: InstanceState, now: float) -> StepPlan:
        plan = keep_one_finishing(inst, self._schedule_strict(inst, now))
        if plan.is_empty:  # every decode short of a block (`tidal.policy.tidal.liveness`)
            return strict_unstick(inst, offload=self._cpu(inst)) or plan
        return plan

    def _schedule_strict(self, inst: InstanceState, now: float) -> StepPlan:
        plan = super().schedule_strict(inst, now)
        if self._cpu(inst) and plan.swap_out:
            # Evicted offline decodes keep decoding with CPU attention (OmniServe §3.3.5).
            return StepPlan(decode=plan.decode, offload=plan.swap_out)
        if (
            self._cpu(inst)
            and self.tcfg.cpu_overflow
            and not (plan.swap_in or plan.recompute or inst.pending_in)
        ):
            return cpu_overflow_step(self, inst, plan, now)
        if self.tcfg.strict_offline_prefill:
            plan = self._strict_prefill(inst, plan, now)
        if not self._cpu(inst):
            return plan
        return self._cpu_batch(inst, plan, now, self.cfg.tpot_slo_s)

    def strict_budget(self, inst: InstanceState, now: float) -> float:
        """Latency budget of a strict step carrying offline work (`tidal.policy.tidal.budget`)."""
        t = self.tcfg
        return strict_step_budget(
            inst, now, self.cfg.tpot_slo_s, t.strict_prefill_budget, t.strict_tpot_target
        )

    def _strict_prefill(self, inst: InstanceState, plan: StepPlan, now: float) -> StepPlan:
        """HyGen Alg. 1 offline phase on a strict instance: the decodes OOCO Alg. 2 chose stay;
        offline prefill chunks are added while the step stays within the latency budget."""
        if plan.swap_out or plan.swap_in or plan.recompute or inst.pending_in:
            return plan
        cands = offline_prefill_candidates(inst)
        if not cands:
            return plan
        b = PlanBuilder(inst)
        by_id = {r.req_id: r for r in inst.running}
        for rid in plan.decode:
            b.add_decode(by_id[rid])
        bound = self.strict_budget(inst, now)
        for r in cands:
            if b.add_prefill(r, bound_s=bound) == 0:
                break
        if not b.prefill:
            return plan
        return StepPlan(prefill=b.prefill, decode=plan.decode)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        plan = super().schedule(inst, now)
        if not plan.is_empty or not self._cpu(inst):
            return plan
        # Idle GPU but offloaded work left: give it its CPU steps.
        return self._cpu_batch(inst, plan, now, self.cfg.tpot_slo_s)


@register_policy("tidal")
def make_tidal(ctx: PolicyContext) -> Policy:
    """Factory of `tidal`; YAML keys are the fields of `TidalConfig` plus an `ooco` section."""
    params = dict(ctx.params)
    ooco_params = parse_section(params, "ooco")
    params.pop("ooco", None)
    return TidalPolicy(ctx, parse_params(TidalConfig, params, "policy tidal"), ooco_params)
