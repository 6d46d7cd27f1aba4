"""Which services are alive, learned from heartbeats alone. Pure: `now` is passed in."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.schemas.messages import Heartbeat


@dataclass
class Member:
    heartbeat: Heartbeat
    first_seen_s: float
    last_seen_s: float

    @property
    def is_instance(self) -> bool:
        return self.heartbeat.kind == "instance"


@dataclass
class Membership:
    """Services keyed by (kind, id). A service silent for `timeout_s` is forgotten."""

    timeout_s: float
    members: dict[tuple[str, str], Member] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"membership timeout must be > 0 s, got {self.timeout_s}")

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True if the service is new (or came back after being forgotten)."""
        key = (hb.kind, hb.service_id)
        member = self.members.get(key)
        is_new = member is None or member.heartbeat.pid != hb.pid
        if member is None or is_new:
            self.members[key] = Member(hb, first_seen_s=now, last_seen_s=now)
        else:
            member.heartbeat = hb
            member.last_seen_s = now
        return is_new

    def expire(self, now: float) -> list[Member]:
        """Forget services silent for longer than `timeout_s`; return them."""
        gone = [m for m in self.members.values() if now - m.last_seen_s > self.timeout_s]
        for m in gone:
            del self.members[(m.heartbeat.kind, m.heartbeat.service_id)]
        return gone

    def silent(self, now: float) -> list[Member]:
        """Services silent for longer than `timeout_s`, kept: suspects to probe before they are
        forgotten (SWIM's suspect state: a missed beat is not yet a death)."""
        return [m for m in self.members.values() if now - m.last_seen_s > self.timeout_s]

    def vouch(self, kind: str, service_id: str, now: float) -> None:
        """The service answered a direct probe: count it as seen now."""
        member = self.members.get((kind, service_id))
        if member is not None:
            member.last_seen_s = max(member.last_seen_s, now)

    def is_cut_off(self, now: float, kind: str, service_id: str) -> bool:
        """Whether the observer (`kind`, `service_id`) is the one cut off: at least two other
        services and every one of them silent at once. Hosts fail one at a time; all of them
        falling silent together is the observer's own link (or its NATS node) gone, and
        forgetting them all would re-place every request for nothing."""
        others = [m for key, m in self.members.items() if key != (kind, service_id)]
        return len(others) >= 2 and all(now - m.last_seen_s > self.timeout_s for m in others)

    def extend(self, now: float) -> None:
        """Count every member as seen at `now`: the observer itself was cut off (its bus
        connection dropped), so missing heartbeats say nothing about the members."""
        for m in self.members.values():
            m.last_seen_s = max(m.last_seen_s, now)

    def forget(self, kind: str, service_id: str) -> Member | None:
        return self.members.pop((kind, service_id), None)

    def instances(self) -> list[Member]:
        return [m for m in self.members.values() if m.is_instance]

    def models(self) -> list[str]:
        return sorted({m.heartbeat.model for m in self.instances() if m.heartbeat.model})
