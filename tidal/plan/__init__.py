"""The plan contract: the types a policy plans with and an engine carries out, owned by neither
(`tidal.policy` and `tidal.engine` both import this package; it imports neither).

The contract itself is written at the top of `tidal.plan.step`; `docs/plan-contract.md` has the
field -> engine table.
"""

from tidal.plan.capabilities import EngineCapabilities, MigrationMode
from tidal.plan.errors import PlanRefused, PolicyError, RefusalReason
from tidal.plan.interpreter import STAGES, Outcome, PlanKernel, carry_out, check_plan
from tidal.plan.step import IDLE, StepPlan
from tidal.schemas.enums import RequestClass

__all__ = [
    "IDLE",
    "STAGES",
    "EngineCapabilities",
    "MigrationMode",
    "Outcome",
    "PlanKernel",
    "PlanRefused",
    "PolicyError",
    "RefusalReason",
    "RequestClass",
    "StepPlan",
    "carry_out",
    "check_plan",
]
