"""Request classes in the simulator: the gateway's rule (`tidal.config.classes`), run on
simulated arrivals so a run gives the same per-class table as the live stack.

A request that names a class (`SimRequest.class_name`) is offered to its class, then down its
demotion chain (`ClassTable.chain`): a class whose queue bound is full (its requests arrived and
not yet finished, as the gateway counts its requests in flight) or whose route the policy
refuses passes it on; none left: rejected, as the gateway's 429. Each try is a `policy.route`
with the class's kind, SLO and priority, as the live gateway routes again per class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tidal.config.classes import ClassTable, RequestClassSpec
from tidal.policy.base import Route, RouteAction
from tidal.policy.state import Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass
from tidal.sim.metrics import slo_flags


def hold(held: list[ReqState], r: ReqState) -> None:
    """Put `r` in the cluster queue: after every held request of its priority or higher
    (FIFO within a priority), as the live scheduler orders `ClusterView.held`."""
    if not held or held[-1].priority >= r.priority:
        held.append(r)  # the usual case: one priority
        return
    at = next(i for i, h in enumerate(held) if h.priority < r.priority)
    held.insert(at, r)


def assign(r: ReqState, spec: RequestClassSpec, default_slo: Slo) -> None:
    """Make `r` a request of class `spec`: its kind, SLO and priority."""
    r.req_class = spec.kind
    r.is_online = spec.kind is RequestClass.ONLINE
    r.slo = None
    if r.is_online:
        r.slo = default_slo.of_request(spec.ttft_ms, spec.tpot_ms)
    r.priority = spec.priority
    r.class_name = spec.name
    r.slo_admission = spec.slo_admission


class ClassGate:
    """Queue bounds and demotion for one simulated run."""

    def __init__(self, table: ClassTable, default_slo: Slo) -> None:
        self.table = table
        self.default_slo = default_slo
        self.open: dict[str, list[ReqState]] = {c.name: [] for c in table.classes}
        self.asked: dict[str, str] = {}  # req_id -> the class it asked for
        self.demotions: Counter[str] = Counter()  # class asked -> requests served looser
        self.rejections: Counter[str] = Counter()  # class asked -> requests no class took

    def in_flight(self, name: str) -> int:
        live = [r for r in self.open[name] if r.finish_s is None]
        self.open[name] = live
        return len(live)

    def route(self, r: ReqState, asked: str, route: Callable[[], Route]) -> Route:
        """Route `r` in class `asked` or the first looser one that takes it (`route()` asks
        the policy for `r` as it stands); a reject when none does."""
        chain = self.table.chain(self.table.get(asked))
        self.asked[r.req_id] = asked
        last = Route.reject(f"class {asked}: no class could take it")
        for spec in chain:
            if not self.table.has_room(spec, self.in_flight(spec.name)):
                last = Route.reject(f"class {spec.name} is full ({spec.queue_bound} in flight)")
                continue
            assign(r, spec, self.default_slo)
            got = route()
            if got.action is RouteAction.REJECT:
                last = got
                continue
            if spec.name != asked:
                self.demotions[asked] += 1
            self.open[spec.name].append(r)
            return got
        assign(r, chain[0], self.default_slo)  # recorded under the class it asked for
        self.rejections[asked] += 1
        return last


@dataclass(frozen=True)
class ClassRow:
    """One class's figures for a run: what it was asked, what it served and how well."""

    name: str
    num_asked: int  # requests that named it
    num_served: int  # requests that ran in it (its own and those demoted into it) and finished
    num_attained: int  # of those served, how many met its SLO (best-effort classes: 0)
    num_demoted: int  # requests that named it and ran in a looser class
    num_rejected: int  # requests that named it and that no class took (a 429 live)
    has_slo: bool
    num_preemptions: int = 0  # evictions (recompute preemptions) of the requests it ran

    @property
    def attainment(self) -> float | None:
        """Share of served requests that met the class's SLO (None: no SLO or none served)."""
        if not self.has_slo or not self.num_served:
            return None
        return self.num_attained / self.num_served


def class_rows(gate: ClassGate, reqs: list[ReqState]) -> list[ClassRow]:
    """The per-class table of a finished run, highest priority first."""
    asked = Counter(gate.asked.values())
    served: Counter[str] = Counter()
    met: Counter[str] = Counter()
    evicted: Counter[str] = Counter()
    for r in reqs:
        if r.class_name and r.req_id in gate.asked:
            evicted[r.class_name] += r.num_preemptions
        if r.class_name and r.phase is Phase.FINISHED and r.req_id in gate.asked:
            served[r.class_name] += 1
            if r.slo is not None and all(slo_flags(r)):
                met[r.class_name] += 1
    return [
        ClassRow(
            c.name,
            asked[c.name],
            served[c.name],
            met[c.name],
            gate.demotions[c.name],
            gate.rejections[c.name],
            not c.best_effort,
            evicted[c.name],
        )
        for c in gate.table.classes
    ]
