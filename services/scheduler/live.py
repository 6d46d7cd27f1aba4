"""The cluster half of a policy, live: the policy's `route`, `place_decode` and `tick` turned into
replies and commands, over the `ClusterView` that `reports.ClusterReports` rebuilds from the
instances' state reports.

- `route`: QUEUE answers the gateway with the instance; HOLD keeps the gateway's request open
  in a bounded queue until `tick` dispatches it; REJECT answers at once (HTTP 429, `Retry-After`).
- `place_decode`: asked once per request, when a report first shows it decoding; another
  instance means a push migration, sent to the source as a `MigrateCommand`.
- `tick`: every `TICK_S` and after reports; its `migrate` list (pull migration, flows) becomes
  `MigrateCommand`s, `set_role`/`set_chunk_size` instance control messages.

`now` is the wall clock (Unix seconds), as in every ReqState the reports carry.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from services.scheduler.reports import (
    CHARS_PER_TOKEN,
    DEFAULT_LINK_BYTES_PER_S,
    ClusterReports,
    Held,
)
from tidal.cluster.backoff import TargetBackoff
from tidal.cluster.healing import RoleHealer, stand_in
from tidal.config.cluster import InstanceGroup
from tidal.config.limits import fit_max_tokens
from tidal.perf.api import StepModel
from tidal.policy.base import ClusterActions, Policy, RouteAction
from tidal.policy.state import ClusterView, InstanceRole, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass
from tidal.schemas.messages import InstanceReport, RouteRequest

log = logging.getLogger("tidal.scheduler")

PLACED_GRACE_S = 120.0  # longer than any migration takes
PLACE_RETRY_S = 0.2  # a push that could not happen is tried again this much later
NO_INSTANCE = "no instance is taking work"
SLOT_DOWN = "the policy's instance for it is down; waiting for it"


@dataclass
class LiveCluster(ClusterReports):
    policy: Policy
    default_slo: Slo
    max_held: int  # bounded cluster queue; past it: 429
    max_hold_s: float  # a held request waits at most this long, then 429
    slots: tuple[InstanceGroup, ...]  # the config's instance slots: the view always has them all
    reports: dict[int, InstanceReport] = field(default_factory=dict)  # slot -> latest
    step_models: dict[str, StepModel] = field(default_factory=dict)  # spec -> model
    held: dict[str, Held] = field(default_factory=dict)  # req_id -> held request (FIFO)
    max_held_tokens: int = 0  # held prompt + output tokens past which: 429 (0: no bound)
    routed: dict[str, tuple[int, ReqState, float]] = field(default_factory=dict)
    # req_id -> when a report last showed it, for requests place_decode already saw
    placed: dict[str, float] = field(default_factory=dict)
    retry_at: dict[str, float] = field(default_factory=dict)  # req_id -> ask place_decode then
    migrating: set[str] = field(default_factory=set)  # req_ids with a command in flight
    cache: dict[str, ReqState] = field(default_factory=dict)
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S  # EWMA of measured transfers
    chars_per_token: float = float(CHARS_PER_TOKEN)  # EWMA, learnt from reports
    prompt_chars: dict[str, int] = field(default_factory=dict)  # routed on an estimate
    healer: RoleHealer = field(default_factory=RoleHealer)  # survivors stand in for lost roles
    backoff: TargetBackoff = field(default_factory=TargetBackoff)  # by target instance id
    num_stand_in_routes: int = 0  # requests routed to a stand-in (their role's slots were down)
    num_stand_in_decodes: int = 0  # decodes kept on, or pushed to, a stand-in
    # (instance id, process start) of processes forgotten, and of those heard again after it:
    # a process declared dead while it lived (its link, or ours, was cut) failed nothing, so a
    # re-run that excludes it may go back to it (it may be the only one of its role)
    forgotten: set[tuple[str, float]] = field(default_factory=set)
    revived: set[tuple[str, float]] = field(default_factory=set)

    # ---- decisions ----

    def room_to_hold(self, req: ReqState) -> str:
        """ "" if `req` may join the held queue, else why not (both bounds: requests, tokens)."""
        if len(self.held) >= self.max_held:
            return f"the scheduler's queue is full ({self.max_held} requests)"
        if self.max_held_tokens:
            held = sum(
                h.req.num_prompt_tokens + h.req.max_output_tokens for h in self.held.values()
            )
            if held + req.num_prompt_tokens + req.max_output_tokens > self.max_held_tokens:
                return f"the scheduler's queue is full ({held} of {self.max_held_tokens} tokens)"
        return ""

    def is_idle(self) -> bool:
        """Nothing held, routed or on any instance: the policy's tick has nothing to move."""
        return (
            not self.held
            and not self.routed
            and not any(rep.requests for rep in self.reports.values())
        )

    def max_model_len(self) -> int:
        """The longest context among the instances reporting (0: none said yet): what a
        request without `max_tokens` is planned with, as the instance fits it."""
        return max((rep.max_model_len for rep in self.reports.values()), default=0)

    def new_request(self, r: RouteRequest, now: float) -> ReqState:
        cls = RequestClass(r.req_class)
        slo = None
        if cls is RequestClass.ONLINE:
            slo = self.default_slo.of_request(r.ttft_slo_ms, r.tpot_slo_ms)
        n = r.num_prompt_tokens or max(1, round(r.num_prompt_chars / self.chars_per_token))
        if not r.num_prompt_tokens and r.num_prompt_chars:
            self.prompt_chars[r.req_id] = r.num_prompt_chars
        return ReqState(
            req_id=r.req_id,
            req_class=cls,
            arrival_s=now,
            num_prompt_tokens=n,
            max_output_tokens=fit_max_tokens(
                r.max_tokens, r.max_tokens_is_default, n, self.max_model_len()
            ),
            slo=slo,
            queued_s=now,
            priority=r.priority,
            class_name=r.class_name,
            slo_admission=r.slo_admission,
        )

    def route(
        self, req: ReqState, now: float, ask: RouteRequest | None = None
    ) -> tuple[RouteAction, int, str]:
        """(action, slot, reason). The policy decides; when it picks a slot whose instance is
        down (or failed this request: `ask.exclude`), the request goes to a live instance of the
        same role, or waits in the held queue (reason `SLOT_DOWN`) until the slot is back:
        an instance `tidal up` restarts returns within seconds, and a relaxed instance's work
        cannot be done by a strict one."""
        if ask is not None:
            self.forget_request(req.req_id)
        view = self.view(now)
        if not any(self.is_usable(i.instance_id, now) for i in view.instances):
            return RouteAction.REJECT, 0, NO_INSTANCE
        decision = self.policy.route(req, view, now)
        if decision.action is RouteAction.REJECT and ask is not None and ask.exclude:
            # A re-placement: the request ran (its client has tokens) until its instance failed
            # it. Admission control is for new arrivals: a late answer beats a lost one, so it
            # goes to the least-queued usable prefill instance (a strict one only if none).
            ok = self._ok(now, ask)
            insts = view.instances
            idx = stand_in(view, lambda i: ok(i) and insts[i].role is not InstanceRole.STRICT)
            idx = stand_in(view, ok) if idx is None else idx
            if idx is not None:
                log.info("re-placing %s on slot %d despite: %s", req.req_id, idx, decision.reason)
                self.routed[req.req_id] = (idx, req, now)
                req.phase, req.instance_id = Phase.WAITING, idx
                return RouteAction.QUEUE, idx, ""
        if decision.action is not RouteAction.QUEUE:
            return decision.action, 0, decision.reason
        idx = self._usable(decision.instance_id, view, now, ask)
        if idx is None and self.healer.is_healing:  # the role is lost: a survivor stands in
            idx = stand_in(view, self._ok(now, ask))
            self.num_stand_in_routes += idx is not None
        if idx is None:
            return RouteAction.HOLD, decision.instance_id, SLOT_DOWN
        self.place(req, idx, now)
        return RouteAction.QUEUE, idx, ""

    def place(self, req: ReqState, idx: int, now: float) -> None:
        """`req` is routed to slot `idx` (queued there)."""
        self.routed[req.req_id] = (idx, req, now)
        req.phase, req.instance_id = Phase.WAITING, idx

    def forget_request(self, req_id: str) -> None:
        """Drop what is known of a request's placement: it is being routed afresh (a request
        whose instance died is recomputed under the same id, and `place_decode` must see it
        again after its new prefill, or it would stay on a relaxed instance forever)."""
        self.placed.pop(req_id, None)
        self.retry_at.pop(req_id, None)
        self.migrating.discard(req_id)

    def _ok(self, now: float, ask: RouteRequest | None) -> Callable[[int], bool]:
        def ok(i: int) -> bool:
            if not self.is_usable(i, now):
                return False
            if ask is None or self.instance_id(i) not in ask.exclude:
                return True
            # The process that failed the request, or a new one started since under its id?
            rep = self.reports[i]
            if (rep.instance_id, rep.started_unix_s) in self.revived:
                return True  # declared dead while it lived: it failed nothing
            return rep.started_unix_s > ask.excluded_at_unix_s

        return ok

    def _usable(
        self, idx: int, view: ClusterView, now: float, ask: RouteRequest | None
    ) -> int | None:
        ok = self._ok(now, ask)
        if ok(idx):
            return idx
        role = view.instances[idx].role if idx < len(view.instances) else None
        same = [i.instance_id for i in view.instances if i.role is role and ok(i.instance_id)]
        if not same:
            return None
        return min(same, key=lambda i: view.instances[i].num_waiting_tokens)

    def decode_placements(self, view: ClusterView, now: float) -> list[tuple[str, int, int]]:
        """(req_id, src slot, dst slot) for requests whose prefill just finished and that the
        policy places elsewhere. A request whose push cannot happen now (its target is not up,
        or refused it: `retry_placement`) is asked about again later, never dropped: a
        relaxed instance does not decode online requests."""
        out = []
        for inst in view.instances:
            for r in inst.running:
                rid = r.req_id
                if rid in self.placed or not r.is_decoding or self.retry_at.get(rid, 0.0) > now:
                    continue
                self.placed[rid] = now
                self.retry_at.pop(rid, None)
                dst = self.policy.place_decode(r, inst, view, now)
                if dst is None or dst == inst.instance_id:
                    continue
                usable = self.is_usable(dst, now)
                if not usable and self.healer.is_healing:
                    # The decode role is lost: a stand-in decodes it (the source itself,
                    # most often); asked again later, it moves once the role is back.
                    alt = stand_in(view, lambda i: self.is_usable(i, now))
                    self.num_stand_in_decodes += 1
                    self.retry_placement(rid, now)
                    if alt is not None and alt != inst.instance_id:
                        out.append((rid, inst.instance_id, alt))
                    continue
                target = self.instance_id(dst)
                if usable and self.backoff.is_backed_off(target, now):
                    # Its last migrations could not reach it: the request stays where it is.
                    self.retry_placement(rid, now, self.backoff.retry_at(target))
                elif usable:
                    out.append((rid, inst.instance_id, dst))
                else:
                    self.retry_placement(rid, now)
        # Forget requests no report has shown for a while (finished); not at once: one in the
        # middle of a migration is in no report, and must not be placed again when it lands.
        for rid in self.placed.keys() & self.cache.keys():
            self.placed[rid] = now
        for rid, seen_s in list(self.placed.items()):
            if now - seen_s > PLACED_GRACE_S:
                del self.placed[rid]
        for rid, at in list(self.retry_at.items()):
            if rid not in self.cache and now - at > PLACED_GRACE_S:
                del self.retry_at[rid]
        return out

    def retry_placement(self, req_id: str, now: float, at: float = 0.0) -> None:
        """Ask `place_decode` about `req_id` again at `at` (default: after `PLACE_RETRY_S`)."""
        self.placed.pop(req_id, None)
        self.retry_at[req_id] = max(at, now + PLACE_RETRY_S)

    def heal(self, now: float) -> dict[int, InstanceRole]:
        """Role changes that heal (or end healing): `RoleHealer` over the config's roles."""
        configured = [InstanceRole(s.role) for s in self.slots]
        return self.healer.update(configured, lambda i: self.is_usable(i, now), now)

    def tick(self, view: ClusterView, now: float) -> ClusterActions:
        actions = self.policy.tick(view, now)
        if not any(self.backoff.is_backed_off(t, now) for t in self.backoff.failing):
            return actions
        # Pulls toward a backed-off target wait: the requests stay on their sources.
        keep = tuple(
            m
            for m in actions.migrate
            if not self.backoff.is_backed_off(self.instance_id(m.dst), now)
        )
        if len(keep) == len(actions.migrate):
            return actions
        return dataclasses.replace(actions, migrate=keep)


async def expire_held(
    cluster: LiveCluster, now: float, reject: Callable[[Msg, str], Awaitable[None]]
) -> None:
    """Answer (reject) held requests that waited longer than `max_hold_s`."""
    for rid, h in list(cluster.held.items()):
        if now - h.since_s > cluster.max_hold_s:
            del cluster.held[rid]
            await reject(h.msg, f"held longer than {cluster.max_hold_s:.0f} s")
