"""Commands the scheduler sends instances on its policy's behalf: migrations (push and pull)
and role / chunk-size changes. Each migration is one request/reply to its source instance, run
as a task so a slow transfer never delays routing; its outcome is published on
`subjects.MIGRATION_EVENTS` (the gateway counts them for `/metrics`) and its measured transfer
rate feeds the view's link bandwidth."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from services.scheduler.live import LiveCluster
from services.scheduler.trace import EventTrace
from tidal.policy.base import ClusterActions
from tidal.schemas import codec, subjects
from tidal.schemas.control import CtlRoles
from tidal.schemas.messages import MigrateCommand, MigrateResult, MigrationEvent

log = logging.getLogger("tidal.scheduler")

MIGRATE_TIMEOUT_S = 60.0  # a whole handshake, KV transfer included
LINK_EWMA = 0.3  # weight of the newest transfer in the link bandwidth estimate


class Commands:
    def __init__(self, nc: NATS, cluster: LiveCluster, trace: EventTrace | None = None) -> None:
        self.nc = nc
        self.cluster = cluster
        self.trace = trace or EventTrace("")
        self.tasks: set[asyncio.Task[None]] = set()
        self.outcomes: dict[str, int] = {}  # "kind:outcome" -> count

    def migrate(self, req_id: str, src: int, dst: int, kind: str) -> None:
        c = self.cluster
        if req_id in c.migrating:
            return
        src_id, dst_id = c.instance_id(src), c.instance_id(dst)
        if not src_id or not dst_id or src_id == dst_id:
            return
        c.migrating.add(req_id)
        task = asyncio.create_task(self._migrate(MigrateCommand(req_id, dst_id, kind), src_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _migrate(self, cmd: MigrateCommand, src_id: str) -> None:
        c = self.cluster
        dst_id = cmd.dst_instance_id
        source_failed = False
        try:
            msg = await self.nc.request(
                subjects.instance_migrate(src_id), codec.encode(cmd), timeout=MIGRATE_TIMEOUT_S
            )
            res = codec.decode(msg.data, MigrateResult)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, codec.DecodeError) as e:
            res = MigrateResult(cmd.req_id, "failed", f"source {src_id}: {type(e).__name__}")
            source_failed = True
        finally:
            c.migrating.discard(cmd.req_id)
        now = time.time()
        if res.outcome == "ok":
            c.backoff.succeeded(dst_id)
        elif res.outcome == "failed" and not source_failed:
            # The target could not be reached (offer unanswered, data plane down): it takes no
            # migration for a while, doubling per failure; the request stays on its source.
            until = c.backoff.failed(dst_id, now)
            log.warning(
                "migration of %s to %s failed (%s); %s backed off for %.1f s",
                cmd.req_id,
                dst_id,
                res.message,
                dst_id,
                until - now,
            )
        if cmd.kind == "push" and res.outcome != "ok" and res.outcome != "unknown_request":
            # It must not stay on its prefill instance; a request its source no longer has
            # (finished, or recomputed elsewhere) is not asked about again.
            c.retry_placement(cmd.req_id, now, c.backoff.retry_at(dst_id))
        key = f"{cmd.kind}:{res.outcome}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if res.outcome == "ok" and res.transfer_s > 0 and res.num_bytes > 0:
            rate = res.num_bytes / res.transfer_s
            c.link_bytes_per_s = (1 - LINK_EWMA) * c.link_bytes_per_s + LINK_EWMA * rate
        event = MigrationEvent(
            req_id=cmd.req_id,
            kind=cmd.kind,
            src_instance_id=src_id,
            dst_instance_id=cmd.dst_instance_id,
            outcome=res.outcome,
            message=res.message,
            num_bytes=res.num_bytes,
            transfer_s=res.transfer_s,
            total_s=res.total_s,
            mode=res.mode,
        )
        self.trace.write(
            "migrated",
            req_id=cmd.req_id,
            kind=cmd.kind,
            outcome=res.outcome,
            num_bytes=res.num_bytes,
            transfer_s=res.transfer_s,
            total_s=res.total_s,
        )
        await self.nc.publish(subjects.MIGRATION_EVENTS, codec.encode(event))

    async def set_roles(self, actions: ClusterActions) -> None:
        c = self.cluster
        ctl = CtlRoles(
            roles={c.instance_id(i): str(r) for i, r in actions.set_role.items()},
            chunk_sizes={c.instance_id(i): n for i, n in actions.set_chunk_size.items()},
        )
        for iid in {*ctl.roles, *ctl.chunk_sizes} - {""}:
            try:
                await self.nc.request(
                    subjects.instance_control(iid), msgspec.json.encode(ctl), timeout=2.0
                )
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                log.warning("instance %s did not take its new role/chunk size", iid)
