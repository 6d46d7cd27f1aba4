"""Builders for every NATS subject Tidal uses. No service writes a subject as a literal."""

from __future__ import annotations

import re

PREFIX = "tidal"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Request/reply, answered by the scheduler (queue group SCHEDULER_QUEUE).
ROUTE = f"{PREFIX}.sched.route"
MODELS = f"{PREFIX}.sched.models"
SCHEDULER_QUEUE = "scheduler"

# Broadcasts.
CANCEL = f"{PREFIX}.req.cancel"
INSTANCE_DOWN = f"{PREFIX}.evt.instance_down"
MIGRATION_EVENTS = f"{PREFIX}.evt.migration"
HEARTBEAT_ALL = f"{PREFIX}.hb.>"

# Control plane: JSON request/reply a person can type.
CTL_STATUS = f"{PREFIX}.ctl.status"
CTL_OFFLINE_PAUSE = f"{PREFIX}.ctl.offline.pause"
CTL_OFFLINE_RESUME = f"{PREFIX}.ctl.offline.resume"
CTL_POLICY = f"{PREFIX}.ctl.policy"  # show the policy (JSON)
CTL_POLICY_SET = f"{PREFIX}.ctl.policy.set"  # switch policy / params / default SLO (JSON)
CTL_POLICY_CHANGED = f"{PREFIX}.evt.policy"  # scheduler -> instances: run this policy now
CTL_ROLES = f"{PREFIX}.ctl.roles"  # instance roles and chunk sizes (TaiChi sliders)
CTL_DRAIN = f"{PREFIX}.ctl.drain"  # drain (or undrain) an instance
CTL_ALL = f"{PREFIX}.ctl.>"
INSTANCE_STATE_ALL = f"{PREFIX}.inst.*.state"
BATCH_JOBS = f"{PREFIX}.batch.jobs"  # .<batch_id>: the JetStream work queue of batch lines
BATCH_STATS = f"{PREFIX}.batch.stats"  # batch service -> gateway metrics, once a second

SERVICE_KINDS = ("gateway", "scheduler", "instance", "cpu_attn", "batch")


def check_token(value: str, what: str = "id") -> str:
    """A subject token: letters, digits, '_' and '-' only (no '.', '*', '>' or spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must be 1-64 characters of [A-Za-z0-9_-]")
    return value


def ping(kind: str, service_id: str) -> str:
    """Liveness probe (request/reply): a service answers while its loop runs."""
    if kind not in SERVICE_KINDS:
        raise ValueError(f"unknown service kind {kind!r}; expected one of {SERVICE_KINDS}")
    return f"{PREFIX}.ping.{kind}.{check_token(service_id, 'service id')}"


def heartbeat(kind: str, service_id: str) -> str:
    if kind not in SERVICE_KINDS:
        raise ValueError(f"unknown service kind {kind!r}; expected one of {SERVICE_KINDS}")
    return f"{PREFIX}.hb.{kind}.{check_token(service_id, 'service id')}"


def instance_submit(instance_id: str) -> str:
    return f"{PREFIX}.inst.{check_token(instance_id, 'instance id')}.submit"


def gateway_tokens(gateway_id: str) -> str:
    return f"{PREFIX}.gw.{check_token(gateway_id, 'gateway id')}.tokens"


def instance_state(instance_id: str) -> str:
    """Instance -> scheduler: `InstanceReport`s."""
    return f"{PREFIX}.inst.{check_token(instance_id, 'instance id')}.state"


def instance_migrate(instance_id: str) -> str:
    """Scheduler -> source instance: `MigrateCommand` (request/reply)."""
    return f"{PREFIX}.inst.{check_token(instance_id, 'instance id')}.migrate"


def instance_control(instance_id: str) -> str:
    """Scheduler -> instance: `CtlRoles` / `CtlDrain` for this instance (JSON request/reply)."""
    return f"{PREFIX}.inst.{check_token(instance_id, 'instance id')}.ctl"


def instance_preempt(instance_id: str) -> str:
    """Scheduler or operator -> instance: `CtlPreempt`, answered with `CtlPreemptReply` (JSON
    request/reply)."""
    return f"{PREFIX}.inst.{check_token(instance_id, 'instance id')}.preempt"


def migrate_offer(instance_id: str) -> str:
    """Source -> target instance: `MigrateOffer` (request/reply)."""
    return f"{PREFIX}.mig.{check_token(instance_id, 'instance id')}.offer"


def migrate_commit(instance_id: str) -> str:
    """Source -> target instance: `MigrateCommit` (request/reply)."""
    return f"{PREFIX}.mig.{check_token(instance_id, 'instance id')}.commit"


def migrate_abort(instance_id: str) -> str:
    """Source -> target instance: `MigrateAbort`."""
    return f"{PREFIX}.mig.{check_token(instance_id, 'instance id')}.abort"
