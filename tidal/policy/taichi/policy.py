"""The `taichi` policy (papers/taichi.md §3) on P-heavy / D-heavy instances.

Instances get their role and chunk size from the sliders (R_PD, S_p, S_d) on the first tick.
Arrivals are routed by length-aware prefill scheduling (Alg. 2; an infeasible request goes to a
random instance that can prefill, as in the paper's experiments, or is rejected / sent to the
least-loaded one).
Prefilled requests start decoding on the least-used D-heavy instance (§3.3 ①); every
`flow_interval_s` the flowing-decode rules (Alg. 1) degrade D-heavy decodes above the memory
watermark to P-heavy instances and bring P-heavy decodes above α·SLO back. Each instance runs
Sarathi-style chunked prefill with its own chunk size.
"""

from __future__ import annotations

import random

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
from tidal.policy.plan_builder import (
    PlanBuilder,
    make_room_for_decodes,
    split_running,
    stuck_online,
)
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState
from tidal.policy.taichi.config import TaichiConfig
from tidal.policy.taichi.flowing import (
    DecodeHost,
    FlowReq,
    choose_decode_host,
    least_loaded,
    select_backflow,
    select_degrading,
)
from tidal.policy.taichi.routing import PrefillTarget, route_prefill

FLOW_INTERVAL_S = 0.05  # how often flowing decode re-evaluates, seconds
# A flow still on another instance this long after it was asked was refused (no room on arrival,
# or preempted before its step ended); it may be chosen again. Transfers take milliseconds.
ASK_TIMEOUT_S = 1.0


class TaichiPolicy(Policy):
    def __init__(self, ctx: PolicyContext, cfg: TaichiConfig) -> None:
        self.cfg = cfg
        self.slo = ctx.online_slo
        self.rng = random.Random(ctx.seed)
        n_p = cfg.p_heavy_count(ctx.num_instances)
        self.roles = [
            InstanceRole.P_HEAVY if i < n_p else InstanceRole.D_HEAVY
            for i in range(ctx.num_instances)
        ]
        self.chunks = [cfg.chunk_p if i < n_p else cfg.chunk_d for i in range(ctx.num_instances)]
        self._configured = False
        self._next_flow = 0.0
        self._ref: dict[str, tuple[float, int]] = {}  # req_id -> (time, tokens) TPOT reset point
        # req_id -> (instance a flow sent it to, when): in flight until it lands or times out
        self._asked: dict[str, tuple[int, float]] = {}

    # -------------------------------------------------------------- routing (Alg. 2)
    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        insts = cluster.instances
        if not self.cfg.length_aware_routing:
            p = [i for i in insts if self.roles[i.instance_id] is InstanceRole.P_HEAVY] or insts
            return Route.to(min(p, key=lambda i: (i.num_waiting_tokens, i.instance_id)).instance_id)
        targets = [
            PrefillTarget(
                i.instance_id,
                self.roles[i.instance_id] is InstanceRole.P_HEAVY,
                i.chunk_size,
                queued_prefill(i),
                decode_shape([r.num_computed_tokens for r in i.running if r.is_decoding]),
                i.step_model,
                i.max_batch_reqs,
            )
            for i in insts
        ]
        kv = req.num_prompt_tokens * insts[0].kv_bytes_per_token
        xfer = cluster.link_latency_s + kv / cluster.link_bytes_per_s
        slo = req.slo.ttft_s if req.slo is not None else self.slo.ttft_s
        got = route_prefill(req.num_prompt_tokens, targets, slo, xfer)
        if got is not None:
            return Route.to(got)
        if self.cfg.on_infeasible == "reject" and req.slo_admission:
            return Route.reject("taichi: no instance meets the TTFT SLO")
        if self.cfg.on_infeasible == "random":
            # §3.4: the paper's experiments assign an infeasible request to a random instance.
            # NOTE: drawn among instances whose chunk budget and request slots are not all taken
            # by decodes: on one that is (a D-heavy chunk of 128 under flowing decode) the prompt
            # would wait for minutes instead of merely missing its TTFT.
            live = [t.instance_id for t in targets if t.can_prefill]
            return Route.to(self.rng.choice(live) if live else self.rng.randrange(len(insts)))
        return Route.to(min(insts, key=lambda i: (i.num_waiting_tokens, i.instance_id)).instance_id)

    # -------------------------------------------------------------- flowing decode (Alg. 1)
    def place_decode(
        self, req: ReqState, inst: InstanceState, cluster: ClusterView, now: float
    ) -> int | None:
        self._ref[req.req_id] = (now, req.num_output_tokens)
        if not self.cfg.flowing_decode:
            return None
        on_d = self.roles[inst.instance_id] is InstanceRole.D_HEAVY
        got = choose_decode_host(
            inst.instance_id, on_d, self._hosts(cluster, InstanceRole.D_HEAVY), inst.blocks_for(
                req.num_computed_tokens + 1
            ),
        )  # fmt: skip
        return None if got == inst.instance_id else got

    def _hosts(self, cluster: ClusterView, role: InstanceRole) -> list[DecodeHost]:
        return [
            DecodeHost(i.instance_id, i.num_used_blocks / i.num_blocks, i.num_free_blocks)
            for i in cluster.instances
            if self.roles[i.instance_id] is role
        ]

    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        if not self._configured:
            self._configured = True
            return ClusterActions(
                set_role=dict(enumerate(self.roles)),
                # NOTE: only sliders given in the policy's params; 0 keeps the experiment's.
                set_chunk_size={i: c for i, c in enumerate(self.chunks) if c > 0},
            )
        if not self.cfg.flowing_decode or now < self._next_flow:
            return ClusterActions()
        self._next_flow = now + FLOW_INTERVAL_S
        moves: list[Migration] = []
        d_hosts = self._hosts(cluster, InstanceRole.D_HEAVY)
        p_hosts = self._hosts(cluster, InstanceRole.P_HEAVY)
        for inst in cluster.instances:
            for r in inst.running:  # flows that landed (or were refused) may be chosen again
                a = self._asked.get(r.req_id)
                if a is not None and (a[0] == inst.instance_id or now - a[1] > ASK_TIMEOUT_S):
                    del self._asked[r.req_id]
            reqs = [self._flow_req(r, now) for r in inst.running if _movable(r, self._asked)]
            back = self.roles[inst.instance_id] is InstanceRole.P_HEAVY
            if back:
                chosen = select_backflow(reqs, self.slo.tpot_s, self.cfg.approach_factor)
                hosts = d_hosts
            else:
                chosen = select_degrading(
                    reqs, inst.num_used_blocks, inst.num_blocks, self.cfg.memory_watermark
                )
                hosts = p_hosts
            blocks = {r.req_id: r.blocks for r in reqs}
            for rid in chosen:
                dst = least_loaded(hosts, blocks[rid] + 1)
                if dst is None:
                    break
                moves.append(Migration(rid, dst))
                self._asked[rid] = (dst, now)
                if back:
                    # §3.3 ③: "upon flowing back, the decode request is logically treated as a
                    # new request, with its output length reset": TPOT and length restart when
                    # it lands. A degrading flow (②) keeps its clock: the TPOT it banked on the
                    # D-heavy instance is the margin the P-heavy instance may spend.
                    self._ref[rid] = (now, -1)
        if len(self._asked) > 4096:
            live = {r.req_id for i in cluster.instances for r in i.running}
            self._asked = {k: v for k, v in self._asked.items() if k in live}
        return ClusterActions(migrate=tuple(moves), next_tick_s=self._next_flow)

    def _flow_req(self, r: ReqState, now: float) -> FlowReq:
        first = r.first_token_s if r.first_token_s is not None else now
        t0, n0 = self._ref.get(r.req_id, (first, 1))
        if n0 < 0:  # landed after a flow: restart its TPOT measurement here
            t0, n0 = now, r.num_output_tokens
            self._ref[r.req_id] = (t0, n0)
        n = r.num_output_tokens - n0
        last = r.last_token_s if r.last_token_s is not None else now
        tpot = (last - t0) / n if n > 0 else 0.0
        return FlowReq(r.req_id, n, tpot, r.num_blocks)

    # -------------------------------------------------------------- steps
    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        return chunked_prefill_step(inst)


def queued_prefill(inst: InstanceState, online_only: bool = False) -> list[int]:
    """Alg. 2 line 3 / §3.4: "the total estimated execution time of the remaining prefill tasks on
    the instance" -- the unfinished prompts of running (partially prefilled) requests first, in
    the order the chunked step serves them, then the waiting queue. Counting only `waiting`
    hid a long prompt as soon as its first chunk ran (and under-estimated Q most on small-chunk
    D-heavy instances, where a prompt stays partially prefilled for many steps). `online_only`
    leaves offline prompts out (Tidal's relaxed instances, where OOCO preempts offline prefill
    at layer granularity for online prefill, §3.4.1)."""
    run = [
        r.num_prefill_left
        for r in inst.running
        if r.phase is Phase.RUNNING and (r.is_online or not online_only)
    ]
    wait = [r.num_prefill_left for r in inst.waiting if r.is_online or not online_only]
    return [n for n in run if n > 0] + wait


def _movable(r: ReqState, asked: dict[str, tuple[int, float]]) -> bool:
    # The true remaining output length is unknown to a scheduler, so a request about to finish
    # may be chosen; its deferred migration is then refused by the cluster, which is harmless.
    return r.phase is Phase.RUNNING and r.is_decoding and r.req_id not in asked


def chunked_prefill_step(inst: InstanceState) -> StepPlan:
    """Sarathi-style step: every decode, then prefill chunks FCFS up to the chunk size; when KV
    runs out the newest running request is preempted (recompute). At most `max_batch_reqs`
    requests in all, prefills included (vLLM's `max_num_seqs`, on which TaiChi runs, §3.5)."""
    if stuck := stuck_online(inst):
        return StepPlan(abort_no_kv=stuck)
    dec, pre = split_running(inst)
    victims = make_room_for_decodes(inst, [r for r in dec if r.phase is Phase.RUNNING])
    if victims:
        return StepPlan(recompute=tuple(r.req_id for r in victims))
    b = PlanBuilder(inst)
    for r in dec:
        if r.phase is Phase.RUNNING and len(b.decode) < inst.max_batch_reqs:
            b.add_decode(r)
    for r in [*pre, *inst.waiting]:
        # NOTE: a prompt takes a request slot too. Prefilling past the cap on an instance whose
        # decodes fill it only made more decodes that could not be stepped (TaiChi §3.3 ①'s
        # in-place decode after a D-heavy prefill), while Alg. 1 (§3.3 ②), which watches HBM
        # alone, moved none of them; docs/results/taichi/README.md measures it.
        if len(b.decode) + len(b.prefill) >= inst.max_batch_reqs:
            break
        if b.chunk_left <= 0 or b.add_prefill(r) == 0:
            break
    if not b.prefill and not b.decode:
        run = [r for r in inst.running if r.phase is Phase.RUNNING]
        off = [r for r in run if not r.is_online]
        return StepPlan(recompute=(off[-1].req_id,)) if len(run) > 1 and off else StepPlan()
    repeat = 4 if not b.prefill and not inst.waiting else 1
    return StepPlan(prefill=b.prefill, decode=tuple(b.decode), max_repeat=repeat)


@register_policy("taichi")
def make_taichi(ctx: PolicyContext) -> Policy:
    """Factory of `taichi`; YAML keys are the fields of `TaichiConfig`."""
    return TaichiPolicy(ctx, parse_params(TaichiConfig, ctx.params, "policy taichi"))
