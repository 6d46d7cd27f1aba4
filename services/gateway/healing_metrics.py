"""Roles healed and migration targets backed off, from the scheduler's heartbeat (its `info`
carries running totals; the counters grow by what each total grew since the last beat of the
same scheduler process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from tidal.schemas.messages import Heartbeat

# scheduler heartbeat info key -> (metric name, help)
_TOTALS = {
    "role_heals_total": (
        "tidal_role_heals",
        "Instances set to stand in (as aggregated) for a role no live instance had",
    ),
    "stand_in_routes_total": (
        "tidal_stand_in_routes",
        "Requests routed to a stand-in because every instance of their role was down",
    ),
    "migration_backoffs_total": (
        "tidal_migration_backoffs",
        "Migrations that could not reach their target, which was then backed off",
    ),
}


class HealingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = {
            key: Counter(name, help_, registry=registry) for key, (name, help_) in _TOTALS.items()
        }
        self._seen: dict[str, tuple[float, dict[str, int]]] = {}  # scheduler -> (start, totals)

    def on_scheduler_beat(self, hb: Heartbeat) -> None:
        started, seen = self._seen.get(hb.service_id, (hb.started_unix_s, {}))
        if started != hb.started_unix_s:  # a new scheduler process counts from 0
            seen = {}
        now: dict[str, int] = {}
        for key, counter in self.counters.items():
            try:
                total = int(hb.info.get(key, "0"))
            except ValueError:
                continue
            now[key] = total
            if total > seen.get(key, 0):
                counter.inc(total - seen.get(key, 0))
        self._seen[hb.service_id] = (hb.started_unix_s, now)
