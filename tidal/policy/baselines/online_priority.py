"""``online-priority``: OOCO §5.1.4's co-location baseline on P/D disaggregation.

Base P/D plus online/offline awareness, as OOCO describes it: offline requests wait in the
cluster queue and go to a prefill instance only while it is idle ("only schedules offline
requests when resources are idle"); the decode batch is capped for offline work ("restricts the
Decode batch size to safeguard online SLOs"); online work is batched first and offline requests
are the preemption victims ("preempts offline requests during online traffic spikes"), swapped
to host memory on decode instances so their KV survives.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.policy.base import (
    NO_ACTIONS,
    ClusterActions,
    Policy,
    PolicyContext,
    Route,
    StepPlan,
    parse_params,
)
from tidal.policy.baselines.aggregated import least_loaded
from tidal.policy.baselines.chunked import chunked_plan
from tidal.policy.baselines.pd import roomiest, split_roles
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState


@dataclass(frozen=True)
class OnlinePriorityConfig:
    """Knobs of the online-priority baseline."""

    max_decode_batch: int = 64  # decode batch cap that offline requests may fill up to
    min_free_decode: float = 0.2  # offline admitted only while decode side has this KV free
    watermark: float = 0.01  # fraction of KV blocks kept free when admitting new requests

    def __post_init__(self) -> None:
        if self.max_decode_batch < 1:
            raise ValueError(f"max_decode_batch must be >= 1, got {self.max_decode_batch}")
        if not 0 <= self.min_free_decode < 1 or not 0 <= self.watermark < 1:
            raise ValueError("min_free_decode and watermark must be in [0, 1)")


class OnlinePriorityPolicy(Policy):
    def __init__(self, cfg: OnlinePriorityConfig, roles: tuple[InstanceRole, ...]) -> None:
        self.cfg = cfg
        self.prefill_ids, self.decode_ids = split_roles(roles)

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        if not req.is_online:
            return Route.hold("offline waits for idle capacity")
        p = least_loaded([cluster.instances[i] for i in self.prefill_ids])
        return Route.to(p.instance_id)

    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        if not cluster.held:
            return NO_ACTIONS
        inst = cluster.instances
        dec_free = sum(inst[i].num_free_blocks for i in self.decode_ids)
        dec_total = sum(inst[i].num_blocks for i in self.decode_ids)
        if dec_free < self.cfg.min_free_decode * dec_total or any(
            inst[i].pending_in for i in self.decode_ids
        ):
            return NO_ACTIONS
        for i in self.prefill_ids:
            p = inst[i]
            if not p.waiting and not any(not r.is_decoding for r in p.running):
                return ClusterActions(dispatch={cluster.held[0].req_id: i})
        return NO_ACTIONS

    def place_decode(
        self, req: ReqState, inst: InstanceState, cluster: ClusterView, now: float
    ) -> int | None:
        if inst.instance_id not in self.prefill_ids:
            return None
        return roomiest(cluster, self.decode_ids)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        if inst.instance_id in self.prefill_ids:
            return chunked_plan(inst, decode=False, online_first=True, watermark=self.cfg.watermark)
        # Online hand-offs waiting for room: make it by swapping offline decodes out.
        need = sum(
            inst.blocks_for(r.num_computed_tokens + 1) for r in inst.pending_in if r.is_online
        )
        if need > inst.num_free_blocks:
            victims: list[str] = []
            free = inst.num_free_blocks
            for r in reversed(inst.running):
                if free >= need:
                    break
                if not r.is_online and r.phase is Phase.RUNNING:
                    victims.append(r.req_id)
                    free += r.num_blocks
            if victims:
                return StepPlan(swap_out=tuple(victims))
        return chunked_plan(
            inst,
            online_first=True,
            offline_decode_cap=self.cfg.max_decode_batch,
            swap_victims=True,
            watermark=self.cfg.watermark,
        )


@register_policy("online-priority")
def make_online_priority(ctx: PolicyContext) -> Policy:
    cfg = parse_params(OnlinePriorityConfig, ctx.params, "policy online-priority")
    return OnlinePriorityPolicy(cfg, ctx.roles)
