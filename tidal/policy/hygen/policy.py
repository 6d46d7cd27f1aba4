"""The `hygen` policy (and `hygen-star`, HyGen* of papers/hygen.md §5.1) on aggregated instances.

Online requests are routed to the instance with the least queued prefill; offline requests wait
in the policy's prefix-ordered queue (App. A.2/A.3) and are dispatched a few at a time. Each step
is formed by the two-phase SLO-aware scheduler (Alg. 1 twice, Alg. 2) against the latency budget;
offline requests the online phase displaces are swapped out (state retained, §4.1) and swapped
back in when the offline phase has room.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

from tidal.policy.base import ClusterActions, Policy, PolicyContext, Route, StepPlan, parse_params
from tidal.policy.hygen.batch import HyReq, two_phase_schedule
from tidal.policy.hygen.config import HygenConfig
from tidal.policy.hygen.prefix_order import OfflineOrder
from tidal.policy.plan_builder import make_room_for_decodes, stuck_online
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, InstanceState, Phase, ReqState


def hy(r: ReqState) -> HyReq:
    return HyReq(r.req_id, r.prefill_target, r.num_computed_tokens, r.num_blocks)


def hygen_config(ctx: PolicyContext, params: dict[str, object] | None = None) -> HygenConfig:
    cfg = parse_params(HygenConfig, dict(ctx.params) if params is None else params, "hygen")
    if cfg.latency_budget_s == 0:
        cfg = replace(cfg, latency_budget_s=ctx.online_slo.tpot_s)
    return cfg


class HygenPolicy(Policy):
    def __init__(self, ctx: PolicyContext, cfg: HygenConfig) -> None:
        self.cfg = cfg
        self.order = OfflineOrder(cfg.prefix_sharing, cfg.utility_ratio, random.Random(ctx.seed))
        self._held: dict[str, ReqState] = {}
        self._tokens = 0.0  # token bucket of HyGen*'s fixed offline rate
        self._bucket_t = 0.0

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        if not req.is_online:
            self.order.add(req.req_id, req.prefix_key, req.arrival_s)
            self._held[req.req_id] = req
            return Route.hold("offline: HyGen offline queue")
        best = min(cluster.instances, key=lambda i: (i.num_waiting_tokens, i.num_requests))
        return Route.to(best.instance_id)

    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        if not self._held:
            return ClusterActions()
        cap = self.cfg.offline_qps_cap
        if cap > 0:
            self._tokens = min(1.0, self._tokens + (now - self._bucket_t) * cap)
            self._bucket_t = now
        out: dict[str, int] = {}
        bucket_empty = False
        for inst in cluster.instances:
            n_wait = sum(1 for r in inst.waiting if not r.is_online)
            while n_wait < self.cfg.offline_buffer and self._held:
                if cap > 0 and self._tokens < 1.0:
                    bucket_empty = True
                    break
                rid = self.order.pick()
                if rid is None:
                    break
                r = self._held[str(rid)]
                if inst.blocks_for(r.num_prompt_tokens + 1) > inst.num_free_blocks:
                    break
                self.order.remove(rid)
                del self._held[str(rid)]
                out[str(rid)] = inst.instance_id
                n_wait += 1
                if cap > 0:
                    self._tokens -= 1.0
        if bucket_empty and not out:
            # Wake when the next token is due; only when the bucket (not a full instance) is
            # what held the dispatch back, else a large cap would tick every 1/cap seconds.
            return ClusterActions(next_tick_s=now + (1.0 - self._tokens) / cap)
        return ClusterActions(dispatch=out) if out else ClusterActions()

    def _offline_waiting(self, inst: InstanceState, run: list[ReqState]) -> Iterable[HyReq]:
        """The waiting offline requests the offline phase may start, in queue order.

        HyGen runs on Sarathi-Serve (§5.1), which allocates the KV blocks of a request's whole
        prompt when it admits it (`can_allocate`, then `_allocate`) and stops admitting at the
        first request that does not fit. The simulator allocates chunk by chunk, so without
        this gate every step would start more offline prompts than memory can finish, and
        online growth would preempt them again and again (recompute churn)."""
        waiting = (r for r in inst.waiting if not r.is_online)
        if not self.cfg.admit_whole_prompt:
            return map(hy, waiting)
        # Blocks already promised to running prefills (their prompts were admitted whole).
        free = inst.num_free_blocks - sum(
            max(0, inst.blocks_for(r.prefill_target) - r.num_blocks)
            for r in run
            if r.num_computed_tokens < r.prefill_target
        )
        out: list[HyReq] = []
        for r in waiting:
            need = inst.blocks_for(r.prefill_target) - r.num_blocks
            if need > free:
                break
            free -= need
            out.append(hy(r))
        return out

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        cfg = self.cfg
        run = [r for r in inst.running if r.phase is Phase.RUNNING]
        # NOTE: Alg. 1's PERFORM_PREEMPTION frees offline memory only; when online decodes alone
        # have outgrown the KV pool (HyGen's engine is vLLM, which then preempts the newest
        # online requests by recompute) the step would be empty forever. Evict as vLLM does:
        # offline first (swapped, state retained, §4.1), then the newest online (recompute).
        swap = cfg.offline_preemption == "swap"
        # Sarathi-Serve (recompute) frees a slot for every decode, offline ones included, by
        # preempting the newest running request (`_schedule`, phase 1); otherwise offline
        # decodes that filled the KV pool would wait forever for a block.
        victims = make_room_for_decodes(
            inst, [r for r in run if r.is_decoding and (r.is_online or not swap)]
        )
        if victims:  # offline only (the plan contract never evicts online work)
            off = tuple(r.req_id for r in victims)
            return StepPlan(swap_out=off) if swap else StepPlan(recompute=off)
        if stuck := stuck_online(inst):
            return StepPlan(abort_no_kv=stuck)
        b = two_phase_schedule(
            inst.step_model,
            cfg.latency_budget_s,
            inst.chunk_size,
            inst.block_size,
            inst.num_free_blocks,
            online_running=[hy(r) for r in run if r.is_online],
            online_waiting=[hy(r) for r in inst.waiting if r.is_online],
            offline_running=[hy(r) for r in run if not r.is_online],
            # NOTE: no new offline prompt starts while offline KV sits swapped out: it would
            # only be swapped out in turn (memory churn over PCIe, §4.1 retains state to avoid
            # exactly that); swapped requests come back first, below.
            offline_waiting=(() if inst.swapped else self._offline_waiting(inst, run)),
            online_prefill_budgeted=cfg.online_prefill_budgeted,
        )
        swap_in: list[str] = []
        if not b.preempted and inst.swapped and not any(r.is_online for r in inst.waiting):
            r = inst.swapped[0]
            used = sum(n for n in b.prefill.values()) // inst.block_size + len(b.decode) + 1
            if inst.blocks_for(r.num_computed_tokens + 1) + used <= inst.num_free_blocks:
                swap_in.append(r.req_id)
        prefill = {str(k): v for k, v in b.prefill.items()}
        decode = tuple(str(x) for x in b.decode)
        repeat = cfg.decode_repeat if decode and not prefill and not inst.waiting else 1
        if b.preempted or swap_in:
            repeat = 1
        preempted = tuple(str(x) for x in b.preempted)
        return StepPlan(
            prefill=prefill,
            decode=decode,
            swap_out=preempted if swap else (),
            recompute=() if swap else preempted,
            swap_in=tuple(swap_in),
            max_repeat=repeat,
        )


@register_policy("hygen")
def make_hygen(ctx: PolicyContext) -> Policy:
    """Factory of `hygen`; YAML keys are the fields of `HygenConfig`."""
    return HygenPolicy(ctx, hygen_config(ctx))


@register_policy("hygen-star")
def make_hygen_star(ctx: PolicyContext) -> Policy:
    """HyGen* (§5.1): Sarathi++ (online-first chunked prefill with preemption, no latency
    budget) with offline admitted at a fixed, profiled QPS (`offline_qps_cap`, default 1/s)."""
    params = dict(ctx.params)
    params.setdefault("offline_qps_cap", 1.0)
    params.setdefault("latency_budget_s", 1e9)  # chunk-bound only, as Sarathi++
    cfg = hygen_config(ctx, params)
    return HygenPolicy(ctx, cfg)
