"""Round-robin routing over live, non-draining instances that serve the model.

The co-location policies (`tidal.policy`) replace this in later work; the interface stays:
given the request and the live instances, return an instance id or a reason it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.cluster.membership import Member


@dataclass(frozen=True)
class RouteDecision:
    instance_id: str = ""  # chosen instance; empty when error_code is set
    error_code: str = ""  # "" | "unknown_model" | "no_capacity"
    message: str = ""


class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def route(self, model: str, instances: list[Member], exclude: list[str]) -> RouteDecision:
        serving = [m for m in instances if m.heartbeat.model == model]
        if not serving:
            known = sorted({m.heartbeat.model for m in instances})
            if not instances:
                return RouteDecision(error_code="no_capacity", message="no instance is up yet")
            return RouteDecision(
                error_code="unknown_model",
                message=f"model {model!r} is not served here; available: {', '.join(known)}",
            )
        ready = sorted(
            (
                m.heartbeat.service_id
                for m in serving
                if m.heartbeat.status == "ok" and m.heartbeat.service_id not in exclude
            ),
        )
        if not ready:
            return RouteDecision(
                error_code="no_capacity", message=f"no instance of {model!r} can take work now"
            )
        choice = ready[self._next % len(ready)]
        self._next += 1
        return RouteDecision(instance_id=choice)
