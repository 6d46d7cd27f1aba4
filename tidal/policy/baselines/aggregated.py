"""``aggregated``: Sarathi-Serve chunked prefill on every instance (PD aggregation)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.policy.base import Policy, PolicyContext, Route, StepPlan, parse_params
from tidal.policy.baselines.chunked import chunked_plan
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, InstanceState, ReqState


@dataclass(frozen=True)
class AggregatedConfig:
    """Knobs of the aggregated baseline."""

    online_first: bool = False  # HyGen's Sarathi++: online first, offline preempted first
    watermark: float = 0.01  # fraction of KV blocks kept free when admitting new requests
    checkpoint_offline: bool = False  # ConServe: checkpoint offline decodes' KV to host memory
    # (`checkpoint_host_gb`) and release preempted ones instead of recomputing them

    def __post_init__(self) -> None:
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


def least_loaded(instances: list[InstanceState]) -> InstanceState:
    """Fewest queued prompt tokens, then fewest resident requests, then lowest id."""
    return min(instances, key=lambda i: (i.num_waiting_tokens, len(i.running), i.instance_id))


class AggregatedPolicy(Policy):
    def __init__(self, cfg: AggregatedConfig) -> None:
        self.cfg = cfg

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        return Route.to(least_loaded(list(cluster.instances)).instance_id)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        return chunked_plan(
            inst,
            online_first=self.cfg.online_first,
            swap_victims=False,
            watermark=self.cfg.watermark,
            checkpoint=self.cfg.checkpoint_offline,
        )


@register_policy("aggregated")
def make_aggregated(ctx: PolicyContext) -> Policy:
    return AggregatedPolicy(parse_params(AggregatedConfig, ctx.params, "policy aggregated"))
