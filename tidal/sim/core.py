"""The discrete-event cluster simulator: the same `Policy` and `StepModel` code as the live system.

Events sit on a heap keyed by (time, sequence number), so ties resolve in insertion order and a
run is a pure function of (workload, policy, seed): the simulator never reads the wall clock.
Each instance runs one *step* at a time; a policy's decode-only plan may ask to repeat
(`StepPlan.max_repeat`), which the simulator runs as one *span* of steps, cut short at the next
step boundary as soon as anything lands on that instance. Plans are applied and checked here
(`tidal.sim.apply`, `tidal.sim.span`), KV moves between instances in `tidal.sim.transfers`,
steps of instances that share devices in `tidal.sim.sharing`; this module owns time, events,
steps and the cluster queue.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from tidal.cluster.view import build_cluster_view, report_of
from tidal.policy.base import ClusterActions, Policy, PolicyError, RouteAction
from tidal.policy.state import (
    ClusterView,
    CpuPoolState,
    InstanceState,
    Phase,
    ReqState,
    order_waiting,
)
from tidal.schemas.enums import RequestClass
from tidal.sim.apply import evict_for_classes, start_span
from tidal.sim.batch_gate import BatchGate
from tidal.sim.classes import ClassGate, hold
from tidal.sim.integrity import check_invariants
from tidal.sim.preempt_signal import PreemptSignals
from tidal.sim.recorder import Recorder
from tidal.sim.resume import Cuts
from tidal.sim.setup import InstanceSetup
from tidal.sim.sharing import DeviceShare
from tidal.sim.span import Span, finish_span
from tidal.sim.transfers import Transfers
from tidal.workload.mix import SimRequest

_STEP, _XFER, _TICK, _HANDOFF = 0, 1, 2, 3  # event kinds
# An idle instance's policy is asked for a plan at most this often (simulated seconds; the live
# instance's idle report interval), so it can ask for work: OOCO's strict instances pull
# offline decodes only after a `schedule` that found room, which an idle one never ran.
IDLE_PLAN_S = 0.5


class Simulator:
    """One run: `Simulator(setups, policy, ...).run(requests)` -> `Recorder` with the results."""

    def __init__(
        self,
        setups: Sequence[InstanceSetup],
        policy: Policy,
        *,
        link_bytes_per_s: float = 25e9,
        link_latency_s: float = 0.0,
        cpu: CpuPoolState | None = None,
        horizon_s: float = math.inf,
        bin_s: float = 10.0,
        check: bool = False,
        via_reports: bool = False,
        dispatch_s: float = 0.0,
        dispatch_s_per_token: float = 0.0,
        batch_max_inflight: int | None = None,
        handoff_delay_s: float = 0.0,
        handout_s: float = 0.0,
        classes: ClassGate | None = None,
        preempt_for_online: bool = False,
        num_devices: int | None = None,
        shared_device_slowdown: float = 1.0,
    ) -> None:
        if dispatch_s < 0 or dispatch_s_per_token < 0:
            raise ValueError("dispatch_s and dispatch_s_per_token must be >= 0")
        if handout_s < 0:
            raise ValueError("handout_s must be >= 0")
        if not 0 <= handoff_delay_s <= link_latency_s:
            raise ValueError("handoff_delay_s must be in [0, link_latency_s] (a part of it)")
        # Offline requests are Batch API lines: at most this many in the cluster (None: all).
        self.batch = None if batch_max_inflight is None else BatchGate(batch_max_inflight)
        self.policy = policy
        # Request classes: queue bounds and demotion, the gateway's rule (None: two kinds).
        self.classes = classes
        # A request reaches the cluster's `route` this long after it arrives: the serving path
        # in front of the scheduler (HTTP, gateway, bus hops, tokenising the prompt), which a
        # live stack spends and its TTFT counts (`tidal bench replay` measures it).
        self.dispatch_s = dispatch_s
        self.dispatch_s_per_token = dispatch_s_per_token
        # A prefill's push reaches its source this long after the step ended (the live
        # scheduler's report -> tick -> migrate command, a part of the link's fixed cost), and
        # the source exports it at its first step boundary from then: the instance loop moves
        # a request between steps, so a step it began meanwhile (the next prefill) runs out
        # first. 0: the push leaves at the prefill's own step boundary, at once.
        self.handoff_delay_s = handoff_delay_s
        # A held request the tick dispatches to an idle instance starts there this long later:
        # the live hand-out (the instance's report that it is free, the scheduler's tick and
        # reply, the Batch API service's submit, the instance's next loop). The request counts
        # as waiting there meanwhile, as the live scheduler's view counts a routed one.
        self.handout_s = handout_s
        self._handout_until = [0.0] * len(setups)  # an idle instance starts nothing before
        # an online request no instance has KV room for preempts offline work (`preempt_signal`)
        self.signals = PreemptSignals() if preempt_for_online else None
        # fewer devices than instances: their steps share them, each slowed the more by
        # `shared_device_slowdown` while they do (`tidal.sim.sharing`)
        self.sharing: DeviceShare | None = None
        if num_devices is not None and num_devices < len(setups):
            step_at = lambda t, p: self._push(t, _STEP, p)  # noqa: E731
            self.sharing = DeviceShare(num_devices, len(setups), step_at, shared_device_slowdown)
        self.instances = [
            InstanceState(
                instance_id=i,
                role=s.role,
                chunk_size=s.chunk_size,
                max_batch_reqs=s.max_batch_reqs,
                block_size=s.block_size,
                num_blocks=s.num_blocks,
                num_free_blocks=s.num_blocks,
                step_model=s.step_model,
                kv_bytes_per_token=s.kv_bytes_per_token,
                pcie_bytes_per_s=s.pcie_bytes_per_s,
                cpu=cpu,
                num_layers=s.num_layers,
                ckpt_capacity_tokens=s.ckpt_capacity_tokens,
            )
            for i, s in enumerate(setups)
        ]
        self.cluster = ClusterView(self.instances, [], link_bytes_per_s, link_latency_s, cpu)
        self.horizon_s = horizon_s
        self.rec = Recorder(len(setups), bin_s)
        self.reqs: dict[str, ReqState] = {}
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._spans: list[Span | None] = [None] * len(setups)
        # Chunks cut at a layer boundary: they keep their layers and resume (OOCO §3.4.1)
        self.cuts: Cuts = {}
        self._idle_plan_s = [0.0] * len(setups)  # when each idle instance is next asked
        self._now = 0.0
        self._num_open = 0  # requests arrived and not finished or rejected
        self.transfers = Transfers(
            self.cluster,
            self.reqs,
            self.rec,
            handoff_delay_s,
            xfer_at=lambda t, p: self._push(t, _XFER, p),
            handoff_at=lambda t, p: self._push(t, _HANDOFF, p),
            interrupt=self._interrupt,
            in_step=lambda i: self._spans[i] is not None,
            cuts=self.cuts,
        )
        self._check = check  # run check_integrity after every event (tests)
        # `via_reports`: the cluster half sees a view rebuilt from instance reports, exactly as
        # the live scheduler builds it (`tidal.cluster.view`). Same decisions (tests), but ~4x
        # slower (34 one-minute runs of configs/*.yaml: 7.3 s -> 29.2 s), so off by default; the
        # halves still share only `InstanceState.hints` either way.
        self._via_reports = via_reports
        self._models = {str(i): s.step_model for i, s in enumerate(setups)}
        self._view_cache: dict[str, ReqState] = {}
        self._num_reports = 0

    def _view(self, now: float) -> ClusterView:
        """What the cluster half may see now: the real state, or (`via_reports`) a view built
        from each instance's report alone, exactly as the live scheduler builds it."""
        if not self._via_reports:
            return self.cluster
        self._num_reports += 1
        seq = self._num_reports
        c = self.cluster
        reports = [
            report_of(i, str(i.instance_id), now, seq, step_model=str(i.instance_id))
            for i in self.instances
        ]
        return build_cluster_view(
            reports,
            self._models,
            c.link_bytes_per_s,
            link_latency_s=c.link_latency_s,
            held=c.held,
            cache=self._view_cache,
            num_incoming={i.instance_id: i.num_incoming for i in self.instances},
            pcie_bytes_per_s=self.instances[0].pcie_bytes_per_s,
            cpu=c.cpu,
        )

    # ---------------------------------------------------------------- events
    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(
        self, requests: Sequence[SimRequest], progress: Callable[[float], None] | None = None
    ) -> Recorder:
        """Replay `requests` (sorted by arrival) until all finish or the horizon passes."""
        n, i = len(requests), 0
        heap = self._heap
        last_progress = 0.0
        if self.dispatch_s or self.dispatch_s_per_token:  # routed later than they arrive
            per_token = self.dispatch_s_per_token
            at = [r.arrival_s + self.dispatch_s + per_token * r.input_tokens for r in requests]
            order = sorted(range(n), key=at.__getitem__)
            requests, route_s = [requests[k] for k in order], [at[k] for k in order]
        else:
            route_s = [r.arrival_s for r in requests]
        while True:
            t_arr = route_s[i] if i < n else math.inf
            t_ev = heap[0][0] if heap else math.inf
            t = t_arr if t_arr <= t_ev else t_ev
            if t == math.inf or t > self.horizon_s:
                break
            if i >= n and self._num_open == 0:
                break
            if t < self._now:
                raise AssertionError(f"time went back: {t} < {self._now}")
            self._now = t
            if t_arr <= t_ev:
                sr = requests[i]
                i += 1
                gate = self.batch
                if gate is None or sr.req_class is RequestClass.ONLINE or gate.admit(sr):
                    self._arrive(sr, t)
            else:
                _, _, kind, payload = heapq.heappop(heap)
                if kind == _STEP:
                    self._step_end(payload, t)  # type: ignore[arg-type]
                elif kind == _XFER:
                    self.transfers.on_xfer(payload, t)  # type: ignore[arg-type]
                elif kind == _HANDOFF:
                    self.transfers.on_handoff(payload, t)  # type: ignore[arg-type]
            if self.batch is not None:
                self._admit_lines(t)
            self._apply(self.policy.tick(self._view(t), t), t)
            self.transfers.retry(t)
            self._kick(t)
            if self.sharing is not None:  # a step started or ended: the others' ends move
                self.sharing.settle(self._spans, self.instances, t)
            if self._check:
                self.check_integrity()
            if progress is not None and t - last_progress >= 1.0:
                progress(t)
                last_progress = t
        self.rec.end_s = self._now
        self.rec.requests = list(self.reqs.values())
        self.rec.num_batch_queued = len(self.batch.queue) if self.batch is not None else 0
        return self.rec

    # ---------------------------------------------------------------- arrivals and routing
    def _admit_lines(self, now: float) -> None:
        """Batch lines that ended free their places: the next queued lines reach the cluster
        now (their `arrival_s`: when they reached it, as the live scheduler records it)."""
        assert self.batch is not None
        while lines := self.batch.release():
            for sr in lines:
                self._arrive(replace(sr, arrival_s=now), now)

    def _arrive(self, sr: SimRequest, now: float) -> None:
        if sr.req_id in self.reqs:
            raise ValueError(f"duplicate request id {sr.req_id}")
        r = ReqState(
            sr.req_id, sr.req_class, sr.arrival_s, sr.input_tokens, sr.output_tokens, sr.slo
        )
        r.queued_s = now
        self.reqs[sr.req_id] = r
        self._num_open += 1
        if self.batch is not None and not r.is_online:
            self.batch.entered(r)
        if self.classes is not None and sr.class_name:
            route = self.classes.route(
                r, sr.class_name, lambda: self.policy.route(r, self._view(now), now)
            )
        else:
            route = self.policy.route(r, self._view(now), now)
        if self.signals is not None:
            route = self.signals.route(r, route, self._view(now))
        if route.action is RouteAction.QUEUE:
            self._enqueue(r, route.instance_id, now)
        elif route.action is RouteAction.HOLD:
            r.phase = Phase.HELD
            hold(self.cluster.held, r)
        else:
            r.phase = Phase.REJECTED
            r.finish_s = now
            self._num_open -= 1
            self.rec.rejections[route.reason or "rejected"] += 1

    def _enqueue(self, r: ReqState, inst_id: int, now: float) -> None:
        if not 0 <= inst_id < len(self.instances):
            raise PolicyError(f"no instance {inst_id} for {r.req_id}")
        inst = self.instances[inst_id]
        r.phase = Phase.WAITING
        r.instance_id = inst_id
        r.queued_s = now
        inst.waiting.append(r)
        order_waiting(inst.waiting, len(inst.waiting) - 1)
        inst.num_waiting_tokens += r.num_prefill_left
        if r.is_online:  # routed at once: it does not wait for a hand-out to land
            self._handout_until[inst_id] = 0.0
        self._interrupt(inst_id, now, r.is_online)

    # ---------------------------------------------------------------- steps
    def _kick(self, now: float) -> None:
        for inst in self.instances:
            iid = inst.instance_id
            if self._spans[iid] is not None or self._handout_until[iid] > now:
                continue
            if inst.waiting or inst.running or inst.swapped or inst.offloaded:
                self._start(inst, now)
            elif now >= self._idle_plan_s[iid]:
                self._idle_plan_s[iid] = now + IDLE_PLAN_S
                self._start(inst, now)  # nothing to run: its policy may still ask for work

    def _start(self, inst: InstanceState, now: float) -> None:
        if self.signals is not None:
            self.signals.take(inst, self.reqs, now, self.rec, self.cuts)
        evict_for_classes(inst, self.reqs, now, self.rec, self.cuts)
        plan = self.policy.schedule(inst, now)
        if plan.is_empty:
            cpu = inst.cpu
            if inst.offloaded and cpu is not None and cpu.busy_until_s > now:
                self._push(cpu.busy_until_s, _TICK, None)  # wake up when the CPU is free
            return
        span = start_span(inst, plan, self.reqs, now, self.rec, self.cuts)
        self._num_open -= span.num_aborted
        self._spans[inst.instance_id] = span
        inst.busy_until_s = span.end_s
        self._push(span.end_s, _STEP, (inst.instance_id, span.version))

    def _interrupt(self, inst_id: int, now: float, online: bool = False) -> None:
        """Something landed on `inst_id`: cut its span at the next step boundary, or for an
        online request and a preemptible step, at the next layer boundary."""
        span = self._spans[inst_id]
        if span is None:
            return
        if (online and span.preempt_at_layer(now)) or span.truncate(now):
            self.instances[inst_id].busy_until_s = span.end_s
            self._push(span.end_s, _STEP, (inst_id, span.version))

    def _step_end(self, payload: tuple[int, int], now: float) -> None:
        inst_id, version = payload
        span = self._spans[inst_id]
        if span is None or span.version != version:
            return  # superseded by a truncation
        inst = self.instances[inst_id]
        self._spans[inst_id] = None
        done, first = finish_span(inst, span, now, self.rec, self.cuts)
        if self.sharing is not None:
            self.sharing.ended(inst, span)
        self._num_open -= done
        for r in first:  # prefill just finished: where does it decode?
            if self._via_reports:
                view = self._view(now)  # again for each: it sees the transfers just started
                dst = self.policy.place_decode(
                    self._view_cache[r.req_id], view.instances[inst_id], view, now
                )
            else:
                dst = self.policy.place_decode(r, inst, self.cluster, now)
            if dst is None or dst == inst_id:
                continue
            self.transfers.place(r, inst, dst, now)
        self.transfers.step_ended(inst_id, now)

    def check_integrity(self) -> None:
        """Assert the invariants: every block accounted for, every request in one place."""
        check_invariants(
            self.instances, self.cluster.held, self.reqs, self.transfers.reserved, self.cuts
        )

    # ---------------------------------------------------------------- cluster actions
    def _apply(self, act: ClusterActions, now: float) -> None:
        if act.dispatch:
            held = self.cluster.held
            moved = set()
            for rid, inst_id in act.dispatch.items():
                r = self.reqs.get(rid)
                if r is None or r.phase is not Phase.HELD:
                    raise PolicyError(f"cannot dispatch {rid}: not held")
                moved.add(rid)
                self._enqueue(r, inst_id, now)
                if self.handout_s and self._spans[inst_id] is None:  # a busy one takes it later
                    self._handout_until[inst_id] = now + self.handout_s
                    self._push(now + self.handout_s, _TICK, None)
            num = len(moved)
            if all(r.req_id in moved for r in held[:num]):
                del held[:num]  # the usual case: dispatched from the head, FIFO
            else:
                held[:] = [r for r in held if r.req_id not in moved]
        for mig in act.migrate:
            self.transfers.migrate(mig.req_id, mig.dst, now)
        for inst_id, role in act.set_role.items():
            self.instances[inst_id].role = role
        for inst_id, size in act.set_chunk_size.items():
            if size < 1:
                raise PolicyError(f"chunk size must be >= 1, got {size}")
            self.instances[inst_id].chunk_size = size
        if act.next_tick_s is not None and act.next_tick_s > now:
            self._push(act.next_tick_s, _TICK, None)
