"""The live stack's view of the cluster config (`tidal.config.cluster`, the simulator's too),
read by the scheduler and by every instance, so one file describes an experiment in both worlds.

`tidal up --config configs/NAME.yaml --policy NAME`: the instances take their roles and chunk
sizes from the policy's instance list (`ClusterConfig.groups_for`), the policy its own section,
and the online SLO is the default for requests that name none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tidal.config.cluster import ClusterConfig, InstanceGroup, load_config
from tidal.configs import config_path
from tidal.policy.base import PolicyContext
from tidal.policy.registry import available_policies
from tidal.policy.state import InstanceRole

DEFAULT_CONFIG = config_path("embedded.yaml")  # shipped in the package (`tidal.configs`)
CONFIG_DIR = DEFAULT_CONFIG.parent


@dataclass(frozen=True)
class LiveConfig:
    cfg: ClusterConfig
    policy: str
    path: str
    roles: tuple[str, ...] = ()  # instead of the config's slots (`tidal up --instances`)

    @property
    def slots(self) -> tuple[InstanceGroup, ...]:
        """One group per instance slot (counts expanded), index = slot. With `roles`, one slot
        per role, each with the config slot's chunk size at that index (else the last one's)."""
        out: list[InstanceGroup] = []
        for g in self.cfg.groups_for(self.policy):
            out += [replace(g, count=1)] * g.count
        if not self.roles:
            return tuple(out)
        return tuple(replace(out[min(i, len(out) - 1)], role=r) for i, r in enumerate(self.roles))

    def context(self, roles: tuple[InstanceRole, ...] | None = None) -> PolicyContext:
        return PolicyContext(
            num_instances=len(roles) if roles is not None else len(self.slots),
            roles=roles if roles is not None else tuple(InstanceRole(g.role) for g in self.slots),
            online_slo=self.cfg.slo,
            params=self.cfg.policy_params(self.policy),
            seed=self.cfg.seed,
        )


def parse_roles(spec: str | Sequence[str]) -> tuple[str, ...]:
    """'relaxed,strict' (or a sequence) -> checked role names; ValueError names a bad one."""
    roles = [r.strip() for r in (spec.split(",") if isinstance(spec, str) else spec)]
    roles = [r for r in roles if r]
    known = [r.value for r in InstanceRole]
    bad = [r for r in roles if r not in known]
    if bad:
        raise ValueError(f"unknown instance role(s) {', '.join(bad)}; use {', '.join(known)}")
    return tuple(roles)


def load_live_config(
    path: str = "", policy: str = "", roles: str | Sequence[str] = ()
) -> LiveConfig:
    """Read `path` (default: configs/embedded.yaml); `policy` defaults to the file's own;
    `roles` (e.g. 'aggregated,aggregated') replaces the config's instance slots, so that the
    scheduler and every instance give the policy the same roles.
    ValueError names what is wrong (a missing file, an unknown policy or role, a bad field)."""
    p = config_path(path or DEFAULT_CONFIG)
    cfg = load_config(p)
    name = (policy or cfg.policy).lower().replace("_", "-")
    if name not in available_policies():
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}")
    live = LiveConfig(cfg, name, str(p), parse_roles(roles))
    check_roles(name, tuple(InstanceRole(g.role) for g in live.slots))
    return live


# Policies whose instances must be latency-relaxed or -strict (OOCO §3.2): online prefill is
# routed only to relaxed instances, so on other roles an online request waits forever.
_OOCO_POLICIES = ("ooco", "tidal")
_OOCO_ROLES = (InstanceRole.RELAXED, InstanceRole.STRICT)


def check_roles(policy: str, roles: Sequence[InstanceRole]) -> None:
    """ValueError when `policy` cannot serve online requests on these instance roles."""
    if policy not in _OOCO_POLICIES:
        return
    bad = sorted({r.value for r in roles if r not in _OOCO_ROLES})
    if bad or InstanceRole.RELAXED not in roles:
        what = f"{', '.join(bad)} instances" if bad else "no relaxed instance"
        raise ValueError(
            f"policy {policy} runs on relaxed and strict instances (OOCO §3.2), got {what}: "
            "online prefill goes only to relaxed instances; use e.g. --instances relaxed,strict, "
            "or a policy for aggregated instances (--policy aggregated)"
        )
