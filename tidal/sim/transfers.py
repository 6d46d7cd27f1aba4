"""KV moves between simulated instances: P/D hand-offs, OOCO pushes (§3.4.3) and migrations.

A move reserves blocks on its target when it starts (a hand-off to a full target waits in the
target's `pending_in` and is retried after every event; a migration to one is refused and
counted), spends the link's fixed cost, then shares the link's bandwidth with the moves under way
(`tidal.sim.link`) and lands in the target's running list. A request in a step right now moves at
that step's end. The event loop (`tidal.sim.core`) owns time: it calls back here at the times
this module asks for.
"""

from __future__ import annotations

from collections.abc import Callable

from tidal.policy.base import PolicyError
from tidal.policy.state import ClusterView, InstanceState, Phase, ReqState
from tidal.sim.link import Flow, SharedLink
from tidal.sim.recorder import Recorder
from tidal.sim.resume import Cuts
from tidal.sim.span import drop_checkpoint

At = Callable[[float, object], None]  # have the event loop call back at a time, with a payload


class Transfers:
    """The KV moves of one run between the instances of `cluster`, and the blocks they hold."""

    def __init__(
        self,
        cluster: ClusterView,
        reqs: dict[str, ReqState],
        rec: Recorder,
        handoff_delay_s: float,
        *,
        xfer_at: At,  # the loop calls `on_xfer(payload, t)` at that time
        handoff_at: At,  # the loop calls `on_handoff(payload, t)` at that time
        interrupt: Callable[[int, float, bool], None],  # something landed on an instance
        in_step: Callable[[int], bool],  # whether an instance is in a step right now
        cuts: Cuts | None = None,  # chunks cut at a layer boundary (`tidal.sim.resume`)
    ) -> None:
        self.cluster = cluster
        self.instances = cluster.instances
        self.reqs = reqs
        self.rec = rec
        # A push reaches its source this long after the step ended (see `Simulator`).
        self.handoff_delay_s = handoff_delay_s
        self._xfer_at = xfer_at
        self._handoff_at = handoff_at
        self._interrupt = interrupt
        self._in_step = in_step
        self._cuts: Cuts = {} if cuts is None else cuts
        n = len(self.instances)
        self.reserved = [0] * n  # blocks reserved for KV in flight to each instance
        # per instance: (req_id, target, is_push) to move out at its step boundary
        self._pending_out: list[list[tuple[str, int, bool]]] = [[] for _ in range(n)]
        # KV transfers share each instance's send and receive side of the link (`tidal.sim.link`)
        self._link = SharedLink(n, cluster.link_bytes_per_s)

    def place(self, r: ReqState, src: InstanceState, dst: int, now: float) -> None:
        """`r`'s prefill just finished on `src` and its decode goes to instance `dst`."""
        if self.handoff_delay_s > 0:
            r.phase = Phase.TRANSFER_WAIT  # asked for: no step schedules it meanwhile
            self._handoff_at(now + self.handoff_delay_s, (r, dst))
        else:
            self.start(r, src, dst, now, is_migration=False)

    def step_ended(self, inst_id: int, now: float) -> None:
        """`inst_id`'s step (or span) just ended: the moves waiting for its boundary start."""
        if self._pending_out[inst_id]:
            pend, self._pending_out[inst_id] = self._pending_out[inst_id], []
            for rid, dst, is_push in pend:
                r = self.reqs[rid]
                if is_push:
                    self._export_push(r, dst, now)
                elif r.phase is Phase.RUNNING and r.instance_id == inst_id and r.is_decoding:
                    self.migrate(rid, dst, now)
                else:  # it finished (or was preempted) in the step it was waiting for
                    self.rec.num_migrations_refused += 1

    def on_handoff(self, payload: tuple[ReqState, int], now: float) -> None:
        """A push asked for `handoff_delay_s` ago reaches its source: exported now, or at the
        end of the step the source is in."""
        r, dst = payload
        src_id = r.instance_id
        assert src_id is not None
        if self._in_step(src_id):
            self._pending_out[src_id].append((r.req_id, dst, True))
            self._interrupt(src_id, now, False)  # a span of repeated steps ends at the next step
            return
        self._export_push(r, dst, now)

    def _export_push(self, r: ReqState, dst: int, now: float) -> None:
        if r.phase is not Phase.TRANSFER_WAIT or r in self.instances[dst].pending_in:
            return  # no longer waiting for this push (NOTE: no policy plans such requests)
        r.phase = Phase.RUNNING
        src = self.instances[r.instance_id]  # type: ignore[index]
        fixed_s = self.cluster.link_latency_s - self.handoff_delay_s  # what is left of it
        self.start(r, src, dst, now, is_migration=False, fixed_s=fixed_s)

    def start(
        self,
        r: ReqState,
        src: InstanceState,
        dst_id: int,
        now: float,
        is_migration: bool,
        fixed_s: float | None = None,
    ) -> bool:
        """Move `r`'s KV to `dst_id`: its bytes go on the link after `fixed_s` (default the
        link's latency) and share it with the transfers moving then; False if it does not fit."""
        if not 0 <= dst_id < len(self.instances):
            raise PolicyError(f"no instance {dst_id} to move {r.req_id} to")
        dst = self.instances[dst_id]
        need = dst.blocks_for(r.num_computed_tokens + 1)
        if need > dst.num_free_blocks:
            if is_migration:
                self.rec.num_migrations_refused += 1
                return False
            if r.phase is not Phase.TRANSFER_WAIT:  # P/D hand-off: hold KV until dst has room
                r.phase = Phase.TRANSFER_WAIT
                dst.pending_in.append(r)
            return False
        if r.phase is Phase.TRANSFER_WAIT:
            dst.pending_in.remove(r)
        dst.num_free_blocks -= need
        dst.num_incoming += 1
        self.reserved[dst_id] += need
        src.num_free_blocks += r.num_blocks
        r.num_blocks = 0
        drop_checkpoint(src, r)
        src.running.remove(r)
        r.phase = Phase.MIGRATING
        # The fixed part (offer, reservation, commit) runs at once; then the bytes share the link.
        fixed = self.cluster.link_latency_s if fixed_s is None else fixed_s
        flow = Flow(
            r, src.instance_id, dst_id, need, r.num_computed_tokens * src.kv_bytes_per_token
        )
        if is_migration:
            r.num_migrations += 1
            self.rec.num_migrations += 1
        else:
            self.rec.num_kv_transfers += 1
        self._xfer_at(now + fixed, (flow, flow.version))
        return True

    def on_xfer(self, payload: tuple[Flow, int], now: float) -> None:
        """A transfer's fixed part is over (its bytes start moving) or its last byte moved."""
        flow, version = payload
        if version != flow.version:
            return  # its end moved since (the link's shares changed)
        if not flow.moving and flow.bytes_left > 0:
            changed = self._link.start(flow, now)
        else:
            changed = self._link.finish(flow, now) if flow.moving else []
            self._land(flow, now)
        for f in changed:
            f.version += 1
            self._xfer_at(self._link.end_s(f), (f, f.version))

    def _land(self, flow: Flow, now: float) -> None:
        r, dst_id, need = flow.req, flow.dst, flow.num_blocks
        dst = self.instances[dst_id]
        dst.num_incoming -= 1
        self.reserved[dst_id] -= need
        r.instance_id = dst_id
        r.num_blocks = need
        r.phase = Phase.RUNNING
        r.queued_s = now
        dst.running.append(r)
        self._interrupt(dst_id, now, r.is_online)

    def retry(self, now: float) -> None:
        """Start the hand-offs waiting for room on their target, in order, while they fit."""
        for dst in self.instances:
            while dst.pending_in:
                r = dst.pending_in[0]
                src = self.instances[r.instance_id]  # type: ignore[index]
                if not self.start(r, src, dst.instance_id, now, is_migration=False):
                    break

    def migrate(self, rid: str, dst: int, now: float) -> None:
        """Move a running decode, KV included, to `dst` (`Migration`): now, or at the end of
        the step it is in."""
        r = self.reqs.get(rid)
        if r is None or r.phase is not Phase.RUNNING or not r.is_decoding:
            raise PolicyError(f"cannot migrate {rid}: not a running decode ({r and r.phase})")
        src_id = r.instance_id
        assert src_id is not None
        if src_id == dst:
            return
        if rid in self._cuts:  # mid-chunk: the live instance refuses (`services/instance`)
            self.rec.num_migrations_refused += 1
            return
        if self._in_step(src_id):  # in a step now: move it at the step boundary
            self._pending_out[src_id].append((rid, dst, False))
            self._interrupt(src_id, now, False)
            return
        self.start(r, self.instances[src_id], dst, now, is_migration=True)
