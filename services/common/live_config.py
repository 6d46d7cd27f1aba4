"""The live stack's configuration: the simulator's YAML (`tidal.sim.config`), read by the
scheduler and by every instance, so one file describes an experiment in both worlds.

`tidal up --config configs/NAME.yaml --policy NAME`: the instances take their roles and chunk
sizes from the policy's instance list (`SimConfig.groups_for`), the policy its own section, and
the online SLO is the default for requests that name none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal.policy.base import InstanceRole, PolicyContext
from tidal.policy.registry import available_policies
from tidal.sim.config import InstanceGroup, SimConfig, load_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "embedded.yaml"


@dataclass(frozen=True)
class LiveConfig:
    cfg: SimConfig
    policy: str
    path: str

    @property
    def slots(self) -> tuple[InstanceGroup, ...]:
        """One group per instance slot (counts expanded), index = slot."""
        out: list[InstanceGroup] = []
        for g in self.cfg.groups_for(self.policy):
            out += [g] * g.count
        return tuple(out)

    def context(self, roles: tuple[InstanceRole, ...] | None = None) -> PolicyContext:
        return PolicyContext(
            num_instances=len(roles) if roles is not None else len(self.slots),
            roles=roles if roles is not None else tuple(InstanceRole(g.role) for g in self.slots),
            online_slo=self.cfg.slo,
            params=self.cfg.policy_params(self.policy),
            seed=self.cfg.seed,
        )


def load_live_config(path: str = "", policy: str = "") -> LiveConfig:
    """Read `path` (default: configs/embedded.yaml); `policy` defaults to the file's own.
    ValueError names what is wrong (a missing file, an unknown policy, a bad field)."""
    p = Path(path) if path else DEFAULT_CONFIG
    if not p.is_file():
        raise ValueError(f"config {p} does not exist")
    cfg = load_config(p)
    name = (policy or cfg.policy).lower().replace("_", "-")
    if name not in available_policies():
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}")
    return LiveConfig(cfg, name, str(p))
