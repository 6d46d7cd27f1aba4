"""The scheduler's control plane (JSON on `tidal.ctl.*`, what `tidal ctl` sends): status, offline
pause/resume, the policy (show, switch, params, default SLO), instance roles and chunk sizes
(TaiChi's sliders), and draining an instance. Nothing here needs a restart."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import respond
from services.scheduler.commands import Commands
from services.scheduler.live import LiveCluster
from tidal.cluster.membership import Member, Membership
from tidal.config.live import LiveConfig
from tidal.policy.base import PolicyContext
from tidal.policy.registry import available_policies, make_policy
from tidal.policy.state import InstanceRole, Slo
from tidal.schemas import subjects
from tidal.schemas.control import CtlDrain, CtlOfflineAdmission, CtlPolicy, CtlRoles
from tidal.schemas.messages import Heartbeat

log = logging.getLogger("tidal.scheduler")


class EmptyCtl(msgspec.Struct):
    """Control requests that take no arguments accept `{}` (or an empty payload)."""


class Controlled(Protocol):
    """What the control plane steers of the scheduler (`main.Scheduler`)."""

    nc: NATS
    service_id: str
    started_unix_s: float
    membership: Membership
    live: LiveConfig
    cluster: LiveCluster
    offline_paused: bool
    params_override: dict[str, object]
    commands: Commands
    num_routed: int
    num_rejected: int
    num_suspects_alive: int


class Control:
    def __init__(self, sched: Controlled) -> None:
        self.s = sched

    async def on_models(self, _: EmptyCtl, msg: Msg) -> None:
        await respond(msg, self.s.membership.models())

    async def on_status(self, _: EmptyCtl, msg: Msg) -> None:
        await respond(msg, self.status(), json=True)

    async def on_pause(self, _: EmptyCtl, msg: Msg) -> None:
        self.s.offline_paused = True
        log.info("offline admission paused by operator")
        await respond(msg, CtlOfflineAdmission(offline_paused=True), json=True)

    async def on_resume(self, _: EmptyCtl, msg: Msg) -> None:
        self.s.offline_paused = False
        log.info("offline admission resumed by operator")
        await respond(msg, CtlOfflineAdmission(offline_paused=False), json=True)

    def policy_state(self) -> dict[str, Any]:
        c, live = self.s.cluster, self.s.live
        return {
            "policy": c.policy.name,
            "params": live.cfg.policy_params(c.policy.name) | self.s.params_override,
            "slo": {"ttft_s": c.default_slo.ttft_s, "tpot_s": c.default_slo.tpot_s},
            "config": live.path,
            "available": available_policies(),
        }

    async def on_policy_show(self, _: EmptyCtl, msg: Msg) -> None:
        await respond(msg, self.policy_state(), json=True)

    async def on_policy_set(self, ctl: CtlPolicy, msg: Msg) -> None:
        """Switch policy, params or default SLO, here and (broadcast) on every instance."""
        s, c = self.s, self.s.cluster
        try:
            name = (ctl.policy or c.policy.name).lower().replace("_", "-")
            params = dict(ctl.params) if ctl.params is not None else s.live.cfg.policy_params(name)
            slo = c.default_slo
            if ctl.ttft_slo_s is not None or ctl.tpot_slo_s is not None:
                slo = Slo(ctl.ttft_slo_s or slo.ttft_s, ctl.tpot_slo_s or slo.tpot_s)
            base = s.live.context(self.roles())
            ctx = PolicyContext(base.num_instances, base.roles, slo, params, base.seed)
            policy = make_policy(name, ctx)
        except (KeyError, ValueError, TypeError) as exc:
            await respond(msg, {"error": str(exc)}, json=True)
            return
        c.policy, c.default_slo = policy, slo
        c.cache.clear()
        s.params_override = dict(ctl.params) if ctl.params is not None else {}
        log.info("policy is now %s (params %s, SLO %s)", name, params, slo)
        change = CtlPolicy(name, params, slo.ttft_s, slo.tpot_s)
        await s.nc.publish(subjects.CTL_POLICY_CHANGED, msgspec.json.encode(change))
        await respond(msg, self.policy_state(), json=True)

    def roles(self) -> tuple[InstanceRole, ...]:
        reps = self.s.cluster.reports
        slots = self.s.live.slots
        return tuple(
            InstanceRole(reps[i].role) if i in reps else InstanceRole(g.role)
            for i, g in enumerate(slots)
        )

    async def on_roles(self, ctl: CtlRoles, msg: Msg) -> None:
        out: dict[str, Any] = {}
        for iid in {*ctl.roles, *ctl.chunk_sizes}:
            try:
                reply = await self.s.nc.request(
                    subjects.instance_control(iid), msgspec.json.encode(ctl), timeout=2.0
                )
                out[iid] = msgspec.json.decode(reply.data)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                out[iid] = {"error": f"instance {iid} did not answer"}
        await respond(msg, out, json=True)

    async def on_drain(self, ctl: CtlDrain, msg: Msg) -> None:
        try:
            reply = await self.s.nc.request(
                subjects.instance_control(ctl.instance_id), msgspec.json.encode(ctl), timeout=2.0
            )
            out = msgspec.json.decode(reply.data)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            out = {"error": f"instance {ctl.instance_id} did not answer"}
        except ValueError as exc:
            out = {"error": str(exc)}
        await respond(msg, out, json=True)

    def status(self) -> dict[str, Any]:
        s = self.s
        now = time.monotonic()
        services = [self._describe(m, now) for m in s.membership.members.values()]
        services.sort(key=lambda d: (subjects.SERVICE_KINDS.index(d["kind"]), d["id"]))
        return {
            "scheduler": s.service_id,
            "offline_paused": s.offline_paused,
            "num_routed": s.num_routed,
            "num_rejected": s.num_rejected,
            "num_held": len(s.cluster.held),
            "migrations": dict(s.commands.outcomes),
            "healing": self.healing(),
            "policy": self.policy_state(),
            "models": s.membership.models(),
            "services": services,
        }

    def healing(self) -> dict[str, Any]:
        """Roles healed and targets backed off (docs/cluster.md)."""
        c = self.s.cluster
        now = time.time()
        return {
            "lost": sorted(c.healer.lost_since),
            "standing_in": sorted(c.instance_id(i) for i in c.healer.standing_in),
            "num_role_heals": c.healer.num_heals,
            "num_stand_in_routes": c.num_stand_in_routes,
            "num_stand_in_decodes": c.num_stand_in_decodes,
            "num_migration_backoffs": c.backoff.num_backoffs,
            "backed_off": sorted(t for t in c.backoff.failing if c.backoff.is_backed_off(t, now)),
        }

    def _describe(self, m: Member, now: float) -> dict[str, Any]:
        hb = m.heartbeat
        out: dict[str, Any] = {
            "kind": hb.kind,
            "id": hb.service_id,
            "pid": hb.pid,
            "status": hb.status,
            "uptime_s": round(now - m.first_seen_s, 1),
            "last_seen_s_ago": round(now - m.last_seen_s, 2),
        }
        if hb.kind == "instance":
            out |= {"role": hb.role, "engine": hb.engine, "model": hb.model}
            out["emulated"] = hb.is_emulated
            if hb.load is not None:
                out["load"] = msgspec.structs.asdict(hb.load)
            rep = next(
                (r for r in self.s.cluster.reports.values() if r.instance_id == hb.service_id),
                None,
            )
            if rep is not None:
                out["slot"] = rep.index
                out["kv_free_blocks"] = rep.num_free_blocks
                out["num_preemptions"] = rep.num_preemptions
                out["policy"] = rep.policy
        if hb.info:
            out["info"] = dict(hb.info)
        return out

    def heartbeat(self) -> Heartbeat:
        s = self.s
        return Heartbeat(
            service_id=s.service_id,
            kind="scheduler",
            pid=os.getpid(),
            started_unix_s=s.started_unix_s,
            sent_unix_s=time.time(),
            info={
                "offline_paused": str(s.offline_paused).lower(),
                "policy": s.cluster.policy.name,
                "suspects_alive": str(s.num_suspects_alive),
                "role_heals_total": str(s.cluster.healer.num_heals),
                "stand_in_routes_total": str(s.cluster.num_stand_in_routes),
                "migration_backoffs_total": str(s.cluster.backoff.num_backoffs),
            },
        )
