"""``pd-disagg`` / ``base-pd``: prefill/decode disaggregation (DistServe; OOCO §5.1.4 base P/D).

Instances whose role is prefill-like (`prefill`, `relaxed`, `p-heavy`) only prefill; the rest
only decode. After its prefill a request's KV moves to the decode instance with the most free
KV blocks. Online and offline requests are treated alike, in arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.policy.base import Policy, PolicyContext, Route, StepPlan, parse_params
from tidal.policy.baselines.aggregated import least_loaded
from tidal.policy.baselines.chunked import chunked_plan
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, ReqState

PREFILL_ROLES = frozenset((InstanceRole.PREFILL, InstanceRole.RELAXED, InstanceRole.P_HEAVY))


@dataclass(frozen=True)
class PdConfig:
    """Knobs of the P/D-disaggregated baseline."""

    watermark: float = 0.01  # fraction of KV blocks kept free when admitting new requests

    def __post_init__(self) -> None:
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


def split_roles(roles: tuple[InstanceRole, ...]) -> tuple[list[int], list[int]]:
    """(prefill instance ids, decode instance ids); both must be non-empty."""
    p = [i for i, r in enumerate(roles) if r in PREFILL_ROLES]
    d = [i for i, r in enumerate(roles) if r not in PREFILL_ROLES]
    if not p or not d:
        raise ValueError(
            f"P/D disaggregation needs prefill-side and decode-side instances, got {roles}"
        )
    return p, d


def roomiest(cluster: ClusterView, ids: list[int]) -> int:
    """The decode instance with the most free blocks net of the hand-offs waiting for it."""
    inst = cluster.instances

    def room(i: int) -> tuple[int, int]:
        pend = sum(inst[i].blocks_for(r.num_computed_tokens + 1) for r in inst[i].pending_in)
        return (inst[i].num_free_blocks - pend, -i)

    return max(ids, key=room)


class PdPolicy(Policy):
    def __init__(self, cfg: PdConfig, roles: tuple[InstanceRole, ...]) -> None:
        self.cfg = cfg
        self.prefill_ids, self.decode_ids = split_roles(roles)

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        p = least_loaded([cluster.instances[i] for i in self.prefill_ids])
        return Route.to(p.instance_id)

    def place_decode(
        self, req: ReqState, inst: InstanceState, cluster: ClusterView, now: float
    ) -> int | None:
        if inst.instance_id not in self.prefill_ids:
            return None
        return roomiest(cluster, self.decode_ids)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        is_prefill = inst.instance_id in self.prefill_ids
        return chunked_plan(inst, decode=not is_prefill, watermark=self.cfg.watermark)


def _make(ctx: PolicyContext) -> Policy:
    return PdPolicy(parse_params(PdConfig, ctx.params, "policy pd-disagg"), ctx.roles)


register_policy("pd-disagg")(_make)
register_policy("base-pd")(_make)
