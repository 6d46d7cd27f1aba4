"""The cluster half of a policy, live: a `ClusterView` rebuilt from the instances' state reports,
and the policy's `route`, `place_decode` and `tick` turned into replies and commands.

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

import msgspec
from nats.aio.msg import Msg

from tidal.cluster.backoff import TargetBackoff
from tidal.cluster.healing import RoleHealer, stand_in
from tidal.cluster.view import build_cluster_view
from tidal.config.cluster import InstanceGroup
from tidal.config.limits import fit_max_tokens
from tidal.perf.api import StepModel
from tidal.perf.spec import parse_step_model
from tidal.policy.base import ClusterActions, Policy, RouteAction
from tidal.policy.state import ClusterView, InstanceRole, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass
from tidal.schemas.messages import InstanceReport, RouteRequest

log = logging.getLogger("tidal.scheduler")

CHARS_PER_TOKEN = 4  # prompt length estimate before an instance tokenises it (a first guess)
CHARS_PER_TOKEN_MIN, CHARS_PER_TOKEN_MAX = 1.0, 8.0
CHARS_PER_TOKEN_EWMA = 0.2  # weight of each newly reported request
MAX_PENDING_ESTIMATES = 10_000
ROUTED_GRACE_S = 5.0  # a routed request not yet in any report still counts this long
DEFAULT_LINK_BYTES_PER_S = 1e9
REPORT_STALE_S = 3.0  # a report this old: the instance takes no new work
PLACED_GRACE_S = 120.0  # longer than any migration takes
PLACE_RETRY_S = 0.2  # a push that could not happen is tried again this much later
NO_INSTANCE = "no instance is taking work"
SLOT_DOWN = "the policy's instance for it is down; waiting for it"


@dataclass
class Held:
    req: ReqState
    msg: Msg
    route: RouteRequest
    since_s: float
    retry_route: bool = False  # held by the scheduler (slot down), not by the policy


@dataclass
class LiveCluster:
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

    # ---- reports -> view ----

    def on_report(self, rep: InstanceReport) -> bool:
        """Keep the newest report per slot; False for a stale (reordered) one. A restarted
        instance (same id, later start) counts its reports from 1 again."""
        old = self.reports.get(rep.index)
        if (
            old is not None
            and (old.instance_id, old.started_unix_s) == (rep.instance_id, rep.started_unix_s)
            and rep.seq <= old.seq
        ):
            return False
        if old is None or (old.instance_id, old.started_unix_s) != (
            rep.instance_id,
            rep.started_unix_s,
        ):
            self.backoff.succeeded(rep.instance_id)  # a new process: its failures were the old's
        self.reports[rep.index] = rep
        if (key := (rep.instance_id, rep.started_unix_s)) in self.forgotten:
            self.forgotten.discard(key)
            self.revived.add(key)
        for rid in rep.finished_req_ids:
            self.routed.pop(rid, None)
        if rep.step_model not in self.step_models:
            try:
                self.step_models[rep.step_model] = parse_step_model(rep.step_model)
            except ValueError as exc:
                log.warning("instance %s: step model %r: %s", rep.instance_id, rep.step_model, exc)
                self.step_models[rep.step_model] = parse_step_model("linear")
        return True

    def _placeholder(self, rep: InstanceReport, index: int) -> InstanceReport:
        """Slot `index` with no live instance: the config's role and chunk size there, no
        requests, no free KV, draining (takes no work). `rep` lends the other fields."""
        out = msgspec.structs.replace(
            rep, instance_id="", index=index, requests=[], num_free_blocks=0, draining=True, seq=0
        )
        if index < len(self.slots):
            slot = self.slots[index]
            out = msgspec.structs.replace(out, role=slot.role, chunk_size=slot.chunk_size)
        return out

    def forget(self, instance_id: str) -> None:
        """The instance is gone: its slot stays in the view, empty and taking no work."""
        for idx, rep in list(self.reports.items()):
            if rep.instance_id == instance_id:
                self.forgotten.add((rep.instance_id, rep.started_unix_s))
                self.reports[idx] = self._placeholder(rep, idx)

    def instance_id(self, index: int) -> str:
        rep = self.reports.get(index)
        return rep.instance_id if rep is not None else ""

    def is_usable(self, index: int, now: float) -> bool:
        rep = self.reports.get(index)
        return (
            rep is not None
            and bool(rep.instance_id)
            and not rep.draining
            and now - rep.sent_unix_s < REPORT_STALE_S
        )

    def view(self, now: float) -> ClusterView:
        reports: list[InstanceReport] = []
        if self.reports:  # slots no instance reported yet are placeholders
            some = next(iter(self.reports.values()))
            n = max(len(self.slots), max(self.reports) + 1)
            reports = [self.reports.get(i) or self._placeholder(some, i) for i in range(n)]
        # Higher request-class priority first, FIFO within a priority (a stable sort).
        held = sorted((h.req for h in self.held.values()), key=_by_priority)
        view = build_cluster_view(
            reports, self.step_models, self.link_bytes_per_s, held=held, cache=self.cache
        )
        by_id = {r.req_id: r for inst in view.instances for r in _all(inst)}
        seen = by_id.keys()
        self._learn_chars_per_token(by_id)
        for rid, (idx, req, t) in list(self.routed.items()):
            if rid in seen or now - t > ROUTED_GRACE_S:
                del self.routed[rid]
                continue
            if idx < len(view.instances):
                inst = view.instances[idx]
                inst.waiting.append(req)
                inst.num_waiting_tokens += req.num_prefill_left
        return view

    def _learn_chars_per_token(self, by_id: dict[str, ReqState]) -> None:
        """The prompt's characters per token, learnt from the tokenised counts the instances
        report for requests routed on a character estimate (the gateway has no tokenizer)."""
        for rid in [rid for rid in self.prompt_chars if rid in by_id]:
            chars = self.prompt_chars.pop(rid)
            tokens = by_id[rid].num_prompt_tokens
            if tokens > 0:
                ratio = min(CHARS_PER_TOKEN_MAX, max(CHARS_PER_TOKEN_MIN, chars / tokens))
                self.chars_per_token += CHARS_PER_TOKEN_EWMA * (ratio - self.chars_per_token)
        if len(self.prompt_chars) > MAX_PENDING_ESTIMATES:  # never reported (finished unseen)
            for rid in list(self.prompt_chars)[: len(self.prompt_chars) // 2]:
                del self.prompt_chars[rid]

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


def _by_priority(req: ReqState) -> int:
    return -req.priority


def _all(inst: object) -> list[ReqState]:
    lists = ("waiting", "running", "swapped", "offloaded", "pending_in")
    return [r for name in lists for r in getattr(inst, name)]


async def expire_held(
    cluster: LiveCluster, now: float, reject: Callable[[Msg, str], Awaitable[None]]
) -> None:
    """Answer (reject) held requests that waited longer than `max_hold_s`."""
    for rid, h in list(cluster.held.items()):
        if now - h.since_s > cluster.max_hold_s:
            del cluster.held[rid]
            await reject(h.msg, f"held longer than {cluster.max_hold_s:.0f} s")
