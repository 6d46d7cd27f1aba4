"""The scheduler's picture of the cluster: the newest state report of every instance slot, the
requests held in its queue and those routed but not yet in a report, turned into the
`ClusterView` a policy decides on (`view`). Slots no live instance holds are placeholders that
take no work; a prompt's length in tokens is estimated from its characters, at a ratio learnt
from the reports. Mixed into `live.LiveCluster`, which owns the state below.

`now` is the wall clock (Unix seconds), as in every ReqState the reports carry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg

from tidal.cluster.backoff import TargetBackoff
from tidal.cluster.view import build_cluster_view
from tidal.config.cluster import InstanceGroup
from tidal.perf.api import StepModel
from tidal.perf.spec import parse_step_model
from tidal.policy.state import ClusterView, ReqState
from tidal.schemas.messages import InstanceReport, RouteRequest

log = logging.getLogger("tidal.scheduler")

CHARS_PER_TOKEN = 4  # prompt length estimate before an instance tokenises it (a first guess)
CHARS_PER_TOKEN_MIN, CHARS_PER_TOKEN_MAX = 1.0, 8.0
CHARS_PER_TOKEN_EWMA = 0.2  # weight of each newly reported request
MAX_PENDING_ESTIMATES = 10_000
ROUTED_GRACE_S = 5.0  # a routed request not yet in any report still counts this long
DEFAULT_LINK_BYTES_PER_S = 1e9
REPORT_STALE_S = 3.0  # a report this old: the instance takes no new work


@dataclass
class Held:
    req: ReqState
    msg: Msg
    route: RouteRequest
    since_s: float
    retry_route: bool = False  # held by the scheduler (slot down), not by the policy


class ClusterReports:
    slots: tuple[InstanceGroup, ...]  # the config's instance slots: the view always has them all
    reports: dict[int, InstanceReport]  # slot -> latest
    step_models: dict[str, StepModel]  # spec -> model
    held: dict[str, Held]  # req_id -> held request (FIFO)
    routed: dict[str, tuple[int, ReqState, float]]  # req_id -> (slot, request, when routed)
    cache: dict[str, ReqState]
    link_bytes_per_s: float  # EWMA of measured transfers
    chars_per_token: float  # EWMA, learnt from reports
    prompt_chars: dict[str, int]  # routed on an estimate
    backoff: TargetBackoff  # by target instance id
    forgotten: set[tuple[str, float]]  # (instance id, process start), see `LiveCluster`
    revived: set[tuple[str, float]]

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


def _by_priority(req: ReqState) -> int:
    return -req.priority


def _all(inst: object) -> list[ReqState]:
    lists = ("waiting", "running", "swapped", "offloaded", "pending_in")
    return [r for name in lists for r in getattr(inst, name)]
