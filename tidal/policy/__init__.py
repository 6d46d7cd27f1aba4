"""Scheduling policies: pure decision code shared by the simulator and the live services.

The interface is in `tidal.policy.base` (read its docstring to write a policy); policies are
looked up by name with `tidal.policy.registry.make_policy`.
"""

from tidal.policy.base import ClusterActions, Migration, Policy, PolicyContext, Route, StepPlan
from tidal.policy.registry import available_policies, make_policy, register_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState, Slo

__all__ = [
    "ClusterActions",
    "ClusterView",
    "InstanceRole",
    "InstanceState",
    "Migration",
    "Phase",
    "Policy",
    "PolicyContext",
    "ReqState",
    "Route",
    "Slo",
    "StepPlan",
    "available_policies",
    "make_policy",
    "register_policy",
]
