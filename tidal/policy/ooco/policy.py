"""The `ooco` policy: OOCO's four scheduling points (papers/ooco.md §3.4) on the shared interface.

* Latency-relaxed instances (§3.2.1): online prefill first and alone (offline work pauses — the
  preemption of §3.4.1: an offline prefill step is cut at a layer boundary and its chunk
  resumed; steps are capped by `offline_step_cap_s`); with no online prefill waiting, offline
  decodes plus gated offline prefill (§3.4.2).
* Latency-strict instances (§3.2.2): mix decoding selection each step (Alg. 2); room for pushed
  online requests is made by evicting offline decodes chosen by bottleneck (§3.4.1).
* Migration (§3.4.3): online requests are pushed to a strict instance after prefill; strict
  instances with slack pull offline decodes with the Alg. 1 length preference.
* Offline requests wait in the cluster queue and are dispatched to relaxed instances by gating.

This module is the cluster half (routing, gating, migration) and the policy's registration; the
instance half, what relaxed and strict instances run each step, is `tidal.policy.ooco.steps`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tidal.perf.api import BatchShape
from tidal.policy.base import ClusterActions, Migration, Policy, PolicyContext, Route, parse_params
from tidal.policy.batch_shape import decode_shape
from tidal.policy.ooco.config import OocoConfig
from tidal.policy.ooco.gating import gate_offline_prefill
from tidal.policy.ooco.migration import (
    StrictView,
    choose_push_target,
    length_preference,
    select_for_pull,
)
from tidal.policy.ooco.mix_decode import DecodeCandidate
from tidal.policy.ooco.steps import (
    OOCO_ROLES,
    PULL_SEQ,
    PULL_SHAPE,
    SHAPE_FIELDS,
    OocoSteps,
    online_waiting_tokens,
)
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, InstanceRole, InstanceState, Phase, ReqState

_EWMA_S = 10.0  # time constant of the online KV-inflow estimate used by gating, seconds
# A pulled decode still running on a relaxed instance this long after its migration was asked was
# refused (mid-chunk after a layer cut, no room on arrival, ...): the policy sees no refusal, so
# the decode is a candidate again. A deferred migration waits one relaxed step (<< 1 s).
ASK_TIMEOUT_S = 1.0


def ooco_config(ctx: PolicyContext, params: dict[str, object] | None = None) -> OocoConfig:
    """OocoConfig from a YAML section; SLOs default to the cluster's online SLO."""
    merged: dict[str, object] = {
        "tpot_slo_s": ctx.online_slo.tpot_s,
        "ttft_slo_s": ctx.online_slo.ttft_s,
    }
    merged.update(dict(ctx.params) if params is None else params)
    return parse_params(OocoConfig, merged, "policy ooco")


class OocoPolicy(OocoSteps):
    """OOCO on relaxed + strict pools."""

    def __init__(self, ctx: PolicyContext, cfg: OocoConfig) -> None:
        super().__init__(ctx, cfg)  # cfg, rng, roles
        self.relaxed: list[int] = []
        self.strict: list[int] = []
        self._set_roles(self.roles)
        self._roles_sent = False
        self._seen_roles: list[InstanceRole] | None = None  # the view's roles at the last look
        self._kv_rate = 0.0  # online prompt tokens per second (EWMA), for gating
        self._kv_t = 0.0
        self._pull_seen: dict[int, float] = {}  # strict id -> PULL_SEQ hint last acted on
        # req_id -> when its migration was asked (it may be deferred to the step boundary)
        self._asked: dict[str, float] = {}

    # ------------------------------------------------------------------ roles
    def _set_roles(self, roles: Sequence[InstanceRole]) -> None:
        self.roles = list(roles)
        self.relaxed = [i for i, r in enumerate(self.roles) if r is InstanceRole.RELAXED]
        self.strict = [i for i, r in enumerate(self.roles) if r is InstanceRole.STRICT]

    def sync_roles(self, cluster: ClusterView) -> None:
        """Adopt the roles instances now report (`tidal.ctl.roles`, a scheduler's set_role):
        a relaxed/strict role the view changed to since the last look replaces ours. Edge, not
        level: a view that still shows a role from before our own set_role reverts nothing."""
        now_roles = [inst.role for inst in cluster.instances]
        seen, self._seen_roles = self._seen_roles, now_roles
        if seen is None or len(seen) != len(now_roles) or len(now_roles) != len(self.roles):
            return
        new = [
            v if v is not old and v in OOCO_ROLES else mine
            for v, old, mine in zip(now_roles, seen, self.roles, strict=True)
        ]
        if new != self.roles and InstanceRole.RELAXED in new:  # online prefill needs a relaxed
            self._set_roles(new)

    # ------------------------------------------------------------------ routing
    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        self.sync_roles(cluster)
        if not req.is_online:
            return Route.hold("offline: dispatched by gating")
        dt = max(now - self._kv_t, 1e-6)
        decay = min(1.0, dt / _EWMA_S)
        self._kv_rate = (1 - decay) * self._kv_rate + req.num_prompt_tokens / _EWMA_S
        self._kv_t = now
        return Route.to(self.pick_prefill_instance(req, cluster, now))

    def pick_prefill_instance(self, req: ReqState, cluster: ClusterView, now: float) -> int:
        """Online prefill goes to the relaxed instance with the least online prefill queued."""
        insts = cluster.instances
        return min(self.relaxed, key=lambda i: (online_waiting_tokens(insts[i]), i))

    def place_decode(
        self, req: ReqState, inst: InstanceState, cluster: ClusterView, now: float
    ) -> int | None:
        self.sync_roles(cluster)
        if not req.is_online or not self.strict:
            return None  # offline decodes stay on the relaxed instance until pulled
        # §3.4.3 push model (+ §3.4.1 eviction plan on the chosen strict instance).
        views = [self._strict_view(cluster.instances[i]) for i in self.strict]
        d = choose_push_target(req.num_computed_tokens + 1, views, self.cfg.saturation_batch_size)
        if d is not None:
            return int(d.instance_id)  # type: ignore[call-overload]
        return min(self.strict, key=lambda i: cluster.instances[i].num_used_blocks)

    def _strict_view(self, inst: InstanceState) -> StrictView:
        off = [
            DecodeCandidate(r.req_id, r.num_computed_tokens)
            for r in inst.running
            if not r.is_online and r.phase is Phase.RUNNING
        ]
        pending = sum(r.num_computed_tokens + 1 for r in inst.pending_in)
        free = inst.num_free_blocks * inst.block_size - pending
        return StrictView(inst.instance_id, free, off, len(inst.running))

    # ------------------------------------------------------------------ cluster actions
    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        self.sync_roles(cluster)
        set_role = {}
        if not self._roles_sent:
            self._roles_sent = True
            set_role = {
                i: r for i, r in enumerate(self.roles) if cluster.instances[i].role is not r
            }
        dispatch = self.dispatch_offline(cluster, now) if cluster.held else {}
        ready = self.pull_ready(cluster)
        migrate = self.pull_migrations(cluster, ready, now) if ready else ()
        if not (set_role or dispatch or migrate):
            return ClusterActions()
        return ClusterActions(dispatch=dispatch, migrate=migrate, set_role=set_role)

    def dispatch_offline(self, cluster: ClusterView, now: float) -> dict[str, int]:
        """§3.4.2 gating: hand held offline requests to relaxed instances that should prefill."""
        out: dict[str, int] = {}
        held = cluster.held
        k = 0
        for i in self.relaxed:
            inst = cluster.instances[i]
            n_wait = sum(1 for r in inst.waiting if not r.is_online)
            while n_wait < self.cfg.offline_buffer and k < len(held):
                r = held[k]
                if not self.admit_offline(inst, r):
                    break
                out[r.req_id] = i
                k += 1
                n_wait += 1
        return out

    def admit_offline(self, inst: InstanceState, r: ReqState) -> bool:
        if not self.cfg.gating_enabled:
            need = inst.blocks_for(r.num_prompt_tokens + 1)
            return need <= inst.num_free_blocks
        dec = [x.num_computed_tokens for x in inst.running if not x.is_online and x.is_decoding]
        return gate_offline_prefill(
            inst.step_model,
            decode_shape(dec),
            r.num_prompt_tokens,
            self.cfg.gating_expected_output_tokens,
            inst.num_free_blocks * inst.block_size,
            self._kv_rate,
        ).admit

    def pull_ready(self, cluster: ClusterView) -> dict[int, BatchShape]:
        """Strict instances whose `schedule` found room since the last look (their PULL_SEQ
        hint moved), each with the batch it ran then; marks them seen."""
        ready: dict[int, BatchShape] = {}
        for sid in self.strict:
            hints = cluster.instances[sid].hints
            seq = hints.get(PULL_SEQ)
            if seq is None or seq == self._pull_seen.get(sid):
                continue
            self._pull_seen[sid] = seq
            ready[sid] = BatchShape(**{f: int(hints[PULL_SHAPE + f]) for f in SHAPE_FIELDS})
        return ready

    def pull_migrations(
        self, cluster: ClusterView, ready: dict[int, BatchShape], now: float
    ) -> tuple[Migration, ...]:
        """§3.4.3 pull model with the Alg. 1 length preference, toward the `ready` strict
        instances (id -> the batch of their last step that had room). A decode asked for less
        than `ASK_TIMEOUT_S` ago is left out; one asked before that and still on a relaxed
        instance was refused and may be pulled again."""
        out: list[Migration] = []
        if len(self._asked) > 4096:  # forget asks old enough to be chosen again anyway
            self._asked = {k: t for k, t in self._asked.items() if now - t < ASK_TIMEOUT_S}
        cands: list[DecodeCandidate] | None = None
        taken: set[str] = set()
        for sid, batch in ready.items():
            inst = cluster.instances[sid]
            if inst.num_incoming or inst.pending_in:
                continue
            if cands is None:
                cands = [
                    DecodeCandidate(r.req_id, r.num_computed_tokens)
                    for i in self.relaxed
                    for r in cluster.instances[i].running
                    if not r.is_online
                    and r.phase is Phase.RUNNING
                    and r.is_decoding
                    and now - self._asked.get(r.req_id, -math.inf) >= ASK_TIMEOUT_S
                    # NOTE: a migration deferred to the step boundary fails in the simulator if
                    # the request finishes in that step; skip requests within a span of the end.
                    and r.max_output_tokens - r.num_output_tokens > self.cfg.decode_repeat + 1
                ]
                if not cands:
                    return ()
            free = inst.num_free_blocks * inst.block_size
            pref = length_preference(
                inst.step_model,
                batch,
                True,
                self.cfg.tpot_slo_s,
                self.cfg.migration_margin,
                self.cfg.saturation_batch_size,
                free,
                min(c.context_tokens for c in cands),
                self.cfg.max_request_tokens,
            )
            if pref is None:
                continue
            pool = [c for c in cands if c.req_id not in taken]
            room = inst.max_batch_reqs - batch.num_decode_reqs
            got = select_for_pull(
                inst.step_model,
                pref,
                pool,
                batch,
                self.cfg.migration_margin * self.cfg.tpot_slo_s,
                free - inst.block_size * max(1, room // 4),
                max(0, room),
            )
            taken.update(str(g) for g in got)
            self._asked.update((str(g), now) for g in got)
            out.extend(Migration(str(g), sid) for g in got)
        return tuple(out)


@register_policy("ooco")
def make_ooco(ctx: PolicyContext) -> Policy:
    """Factory of the `ooco` policy; YAML keys are the fields of `OocoConfig`."""
    return OocoPolicy(ctx, ooco_config(ctx))
