"""Roles heal: when no live instance can do a part of online serving (prefill, or decode) that
the config's roles cover, the survivors stand in as `aggregated` instances (prefill and decode,
Sarathi-style) until an instance of the lost role is back, so online service continues —
degraded, and counted — instead of waiting for an instance that may never return (a lost host).

A role is lost only after `heal_after_s` without it: an instance `tidal up` restarts returns
within seconds, and until then its work waits for it as before. What a stand-in does is the
policy's: OOCO's instance half runs an `aggregated` instance as Sarathi-Serve does
(`OocoConfig.stand_in`), as TaiChi's sliders turn an instance's chunk size — a setting the
scheduler sends (`ClusterActions.set_role`), not a new kind of instance. Pure: `now` and which
slots are usable are passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tidal.policy.state import ClusterView, InstanceRole

R = InstanceRole
# The parts of online serving each role does.
PREFILLS = frozenset((R.AGGREGATED, R.PREFILL, R.RELAXED, R.P_HEAVY, R.D_HEAVY))
DECODES = frozenset((R.AGGREGATED, R.DECODE, R.STRICT, R.P_HEAVY, R.D_HEAVY))
STAND_IN = R.AGGREGATED


def lost_parts(configured: Sequence[InstanceRole], alive: Sequence[int]) -> list[str]:
    """The parts of online serving ("prefill", "decode") some configured role does and no alive
    slot's configured role does."""
    have = {configured[i] for i in alive}
    out = []
    for part, roles in (("prefill", PREFILLS), ("decode", DECODES)):
        if roles & set(configured) and not roles & have:
            out.append(part)
    return out


@dataclass
class RoleHealer:
    """Decides which survivors stand in, and when they go back to their configured roles."""

    heal_after_s: float = 5.0  # a part lost this long (seconds) makes the survivors stand in
    lost_since: dict[str, float] = field(default_factory=dict)  # lost part -> since when (s)
    standing_in: dict[int, InstanceRole] = field(default_factory=dict)  # slot -> its own role
    num_heals: int = 0  # survivors set to stand in, over the scheduler's life

    def __post_init__(self) -> None:
        if self.heal_after_s < 0:
            raise ValueError(f"heal_after_s must be >= 0 s, got {self.heal_after_s}")

    @property
    def is_healing(self) -> bool:
        return bool(self.standing_in)

    def update(
        self, configured: Sequence[InstanceRole], usable: Callable[[int], bool], now: float
    ) -> dict[int, InstanceRole]:
        """Role changes to send now (slot -> role): every usable slot stands in while a part has
        been lost for `heal_after_s`; each goes back to its configured role once no part is."""
        alive = [i for i in range(len(configured)) if usable(i)]
        lost = lost_parts(configured, alive)
        for part in list(self.lost_since):
            if part not in lost:
                del self.lost_since[part]
        for part in lost:
            self.lost_since.setdefault(part, now)
        out: dict[int, InstanceRole] = {}
        if alive and any(now - self.lost_since[p] >= self.heal_after_s for p in lost):
            for i in alive:
                if i not in self.standing_in and configured[i] is not STAND_IN:
                    self.standing_in[i] = configured[i]
                    out[i] = STAND_IN
                    self.num_heals += 1
        elif not lost:
            for i, own in list(self.standing_in.items()):
                del self.standing_in[i]
                if usable(i):
                    out[i] = own
        return out


def stand_in(view: ClusterView, usable: Callable[[int], bool]) -> int | None:
    """The usable instance to take work meant for a lost role: the one with the least prefill
    queued (then the most free KV). None when none is usable."""
    insts = view.instances
    alive = [i.instance_id for i in insts if usable(i.instance_id)]
    if not alive:
        return None
    return min(alive, key=lambda i: (insts[i].num_waiting_tokens, -insts[i].num_free_blocks, i))
