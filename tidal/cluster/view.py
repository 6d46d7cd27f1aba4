"""Views of instances as messages, and back: pure functions shared by the live services and the
simulator (DESIGN.md, "The live loop").

- `report_of(inst, ...)`: an `InstanceState` as the `InstanceReport` its instance publishes.
- `build_cluster_view(reports, ...)`: the scheduler's `ClusterView`, built from reports alone, so
  the cluster half of a policy (`route`, `place_decode`, `tick`) sees what a live scheduler sees.
- `sync_instance(inst, snaps, reqs, ...)`: an engine's `SeqSnapshot`s mirrored into the
  instance's own `InstanceState`, for the instance half (`schedule`).

Times: a report carries Unix seconds, and the live system passes wall-clock Unix seconds as `now`
to a policy, so `ReqState` times are copied as they are. A time of 0 in a report means "not yet"
(`None` in a `ReqState`).

`ReqState` objects are reused: pass the same `cache` (req_id -> ReqState) to every call and a
request keeps one object for its whole life, updated in place. Policies key bookkeeping by
`req_id` and some keep references (HyGen's and Tidal's held queues, TaiChi's flow clocks), so a
fresh object per view would leave them reading stale copies.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

from tidal.engine.api import SeqSnapshot
from tidal.perf.api import StepModel
from tidal.policy.state import (
    ClusterView,
    CpuPoolState,
    InstanceRole,
    InstanceState,
    Phase,
    ReqState,
    Slo,
    order_waiting,
)
from tidal.schemas.enums import RequestClass
from tidal.schemas.messages import InstanceReport, ReqReport

__all__ = [
    "PENDING_IN",
    "SUBMITTED",
    "build_cluster_view",
    "report_of",
    "req_report",
    "sync_instance",
]

# `ReqReport.phase` of a request listed in `InstanceState.pending_in`: prefilled on another
# instance (which reports it as "transfer_wait"), placed here, waiting for room. Every other
# phase string is the request's `Phase` value.
PENDING_IN = "pending_in"
# ... of a request its instance has taken but not yet handed to its engine (that happens at the
# next step boundary): queued there, as a waiting request is.
SUBMITTED = "submitted"

_LISTED = {
    Phase.WAITING.value: "waiting",
    Phase.RUNNING.value: "running",
    Phase.TRANSFER_WAIT.value: "running",  # its KV stays on the prefill instance
    Phase.SWAPPED.value: "swapped",
    Phase.OFFLOADED.value: "offloaded",
    PENDING_IN: "pending_in",
    SUBMITTED: "waiting",
}  # report phase -> InstanceState list; any other phase (migrating) is in no list
_SNAP_PHASE = {
    "waiting": Phase.WAITING,
    "running": Phase.RUNNING,
    "swapped": Phase.SWAPPED,
    "offloaded": Phase.OFFLOADED,
}


def req_report(r: ReqState, phase: str | None = None) -> ReqReport:
    """`r` as its instance's report carries it (`phase`: its `Phase` value unless given)."""
    slo = r.slo
    return ReqReport(
        r.req_id,
        r.req_class.value,
        r.phase.value if phase is None else phase,
        r.arrival_s,
        r.num_prompt_tokens,
        r.max_output_tokens,
        r.num_computed_tokens,
        r.num_output_tokens,
        r.num_blocks,
        slo.ttft_s if slo is not None else 0.0,
        slo.tpot_s if slo is not None else 0.0,
        r.start_s or 0.0,
        r.first_token_s or 0.0,
        r.last_token_s or 0.0,
        r.max_tbt_s,
        r.num_preemptions,
        r.num_migrations,
        r.priority,
    )


def report_of(
    inst: InstanceState,
    instance_id: str,
    now_unix_s: float,
    seq: int,
    *,
    step_model: str = "",
    data_url: str = "",
    policy: str = "",
    draining: bool = False,
    started_unix_s: float = 0.0,
    num_preemptions: int = 0,
    plan_refusals: dict[str, int] | None = None,
    num_steps: int = 0,
    last_step_ms: float = 0.0,
    emulated: bool = False,
    finished_req_ids: list[str] | None = None,
    max_model_len: int = 0,
) -> InstanceReport:
    """`inst` and its requests as the `InstanceReport` number `seq` of the instance named
    `instance_id`, sent at `now_unix_s`. `step_model` is the spec `build_cluster_view` looks the
    latency model up by. Requests go in list order: waiting, running, swapped, offloaded, then
    pending_in (phase `PENDING_IN`)."""
    reqs = [req_report(r, "waiting") for r in inst.waiting]
    reqs += [req_report(r) for r in inst.running]
    reqs += [req_report(r, "swapped") for r in inst.swapped]
    reqs += [req_report(r, "offloaded") for r in inst.offloaded]
    reqs += [req_report(r, PENDING_IN) for r in inst.pending_in]
    return InstanceReport(
        instance_id=instance_id,
        index=inst.instance_id,
        seq=seq,
        sent_unix_s=now_unix_s,
        role=inst.role.value,
        chunk_size=inst.chunk_size,
        max_batch_reqs=inst.max_batch_reqs,
        block_size=inst.block_size,
        num_blocks=inst.num_blocks,
        num_free_blocks=inst.num_free_blocks,
        kv_bytes_per_token=inst.kv_bytes_per_token,
        step_model=step_model,
        data_url=data_url,
        requests=reqs,
        busy_until_unix_s=inst.busy_until_s,
        policy=policy,
        hints=dict(inst.hints),
        draining=draining,
        started_unix_s=started_unix_s,
        num_preemptions=num_preemptions,
        plan_refusals=dict(plan_refusals or {}),
        num_steps=num_steps,
        last_step_ms=last_step_ms,
        emulated=emulated,
        finished_req_ids=list(finished_req_ids or []),
        max_model_len=max_model_len,
    )


def _update_req(r: ReqState, rr: ReqReport) -> None:
    """Copy what a report says about a request into its `ReqState`."""
    r.num_prompt_tokens = rr.num_prompt_tokens
    r.max_output_tokens = rr.max_output_tokens
    r.num_computed_tokens = rr.num_computed_tokens
    r.num_output_tokens = rr.num_output_tokens
    r.num_blocks = rr.num_blocks
    r.start_s = rr.start_unix_s or None
    r.first_token_s = rr.first_token_unix_s or None
    r.last_token_s = rr.last_token_unix_s or None
    r.max_tbt_s = rr.max_tbt_s
    r.num_preemptions = rr.num_preemptions
    r.num_migrations = rr.num_migrations
    r.priority = rr.priority


def _new_req(rr: ReqReport) -> ReqState:
    slo = Slo(rr.ttft_slo_s, rr.tpot_slo_s) if rr.ttft_slo_s > 0 and rr.tpot_slo_s > 0 else None
    return ReqState(
        rr.req_id,
        RequestClass(rr.req_class),
        rr.arrival_unix_s,
        rr.num_prompt_tokens,
        rr.max_output_tokens,
        slo,
    )


def build_cluster_view(
    reports: Sequence[InstanceReport],
    step_models: Mapping[str, StepModel],
    link_bytes_per_s: float,
    *,
    link_latency_s: float = 0.0,
    held: Sequence[ReqState] = (),
    cache: MutableMapping[str, ReqState] | None = None,
    num_incoming: Mapping[int, int] | None = None,
    pcie_bytes_per_s: float = 25e9,
    cpu: CpuPoolState | None = None,
) -> ClusterView:
    """A `ClusterView` from the latest report of every instance, and nothing else.

    `reports` must hold one report per slot 0..n-1 (any order); `step_models` maps each
    report's `step_model` spec to its latency model. `held` are the requests the caller holds in
    its cluster queue (`RouteAction.HOLD`), in order. `cache` (req_id -> ReqState, updated in
    place) makes a request keep one `ReqState` across calls; requests absent from every report
    and from `held` are dropped from it. What reports do not carry comes from the caller:
    `num_incoming` (slot -> migrations it started toward that slot and has not seen land),
    `pcie_bytes_per_s`, and the CPU-attention pool `cpu`.
    """
    by_index = sorted(reports, key=lambda rep: rep.index)
    if [rep.index for rep in by_index] != list(range(len(by_index))):
        raise ValueError(f"reports must cover slots 0..n-1, got {[r.index for r in by_index]}")
    reqs: MutableMapping[str, ReqState] = {} if cache is None else cache
    seen: set[str] = set()
    incoming = num_incoming or {}
    instances: list[InstanceState] = []
    pending: list[tuple[InstanceState, ReqReport]] = []
    for rep in by_index:
        try:
            model = step_models[rep.step_model]
        except KeyError:
            raise ValueError(f"no step model for spec {rep.step_model!r}") from None
        inst = InstanceState(
            instance_id=rep.index,
            role=InstanceRole(rep.role),
            chunk_size=rep.chunk_size,
            max_batch_reqs=rep.max_batch_reqs,
            block_size=rep.block_size,
            num_blocks=rep.num_blocks,
            num_free_blocks=rep.num_free_blocks,
            step_model=model,
            kv_bytes_per_token=rep.kv_bytes_per_token,
            pcie_bytes_per_s=pcie_bytes_per_s,
            cpu=cpu,
            num_incoming=incoming.get(rep.index, 0),
            busy_until_s=rep.busy_until_unix_s,
            hints=dict(rep.hints),
        )
        instances.append(inst)
        num_waiting_tokens = 0
        for rr in rep.requests:
            if rr.phase == PENDING_IN:
                pending.append((inst, rr))
                continue
            r = reqs.get(rr.req_id)
            if r is None:
                r = reqs[rr.req_id] = _new_req(rr)
            _update_req(r, rr)
            r.phase = Phase.WAITING if rr.phase == SUBMITTED else Phase(rr.phase)
            r.instance_id = rep.index
            seen.add(rr.req_id)
            where = _LISTED.get(rr.phase)
            if where is None:
                continue
            getattr(inst, where).append(r)
            if where == "waiting":
                num_waiting_tokens += r.num_prefill_left
        inst.num_waiting_tokens = num_waiting_tokens
    for inst, rr in pending:  # after the prefill instances' reports, which own the request
        r = reqs.get(rr.req_id)
        if r is None:
            r = reqs[rr.req_id] = _new_req(rr)
        if rr.req_id not in seen:  # its prefill instance did not report it (yet)
            _update_req(r, rr)
            r.phase = Phase.TRANSFER_WAIT
            seen.add(rr.req_id)
        inst.pending_in.append(r)
    held_list = list(held)
    if cache is not None:
        seen.update(r.req_id for r in held_list)
        for rid in [rid for rid in cache if rid not in seen]:
            del cache[rid]
    return ClusterView(instances, held_list, link_bytes_per_s, link_latency_s, cpu)


def sync_instance(
    inst: InstanceState,
    snaps: Sequence[SeqSnapshot],
    reqs: MutableMapping[str, ReqState],
    num_free_blocks: int,
    *,
    slos: Mapping[str, Slo | None] | None = None,
    now: float = 0.0,
) -> None:
    """Mirror an engine's requests (`snaps`, in arrival order) into `inst` in place: its
    waiting, running and swapped lists are rebuilt from the snapshots' status, `num_free_blocks`
    is the engine's and `num_waiting_tokens` is recomputed. `reqs` (req_id -> ReqState) is
    updated in place: a request keeps its object, a new one gets one (its SLO from `slos`,
    `queued_s` = `now`), and one the engine no longer has is dropped unless `inst.pending_in`
    (which the engine does not know) still lists it. Offloaded requests (KV on CPU-attention
    workers) are the engine's too: `inst.offloaded` is rebuilt from the snapshots. Times the
    engine does not know (first token, ...) are left to the caller."""
    waiting: list[ReqState] = []
    running: list[ReqState] = []
    swapped: list[ReqState] = []
    offloaded: list[ReqState] = []
    num_waiting_tokens = 0
    live: set[str] = set()
    for s in snaps:
        r = reqs.get(s.req_id)
        if r is None:
            slo = slos.get(s.req_id) if slos is not None else None
            r = ReqState(
                s.req_id,
                RequestClass(s.req_class),
                s.arrival_s,
                s.num_prompt_tokens,
                s.max_output_tokens,
                slo,
            )
            r.queued_s = now
            reqs[s.req_id] = r
        r.num_prompt_tokens = s.num_prompt_tokens
        r.max_output_tokens = s.max_output_tokens
        r.num_computed_tokens = s.num_computed_tokens
        r.num_output_tokens = s.num_output_tokens
        r.num_blocks = s.num_blocks
        r.num_checkpointed_tokens = s.num_checkpointed_tokens
        r.is_released = s.is_released
        r.priority = s.priority
        r.instance_id = inst.instance_id
        phase = _SNAP_PHASE.get(s.status)
        if phase is None:
            raise ValueError(f"{s.req_id}: unknown engine status {s.status!r}")
        r.phase = phase
        live.add(s.req_id)
        if phase is Phase.WAITING:
            waiting.append(r)
            num_waiting_tokens += r.num_prefill_left
        elif phase is Phase.RUNNING:
            running.append(r)
        elif phase is Phase.OFFLOADED:
            offloaded.append(r)
        else:
            swapped.append(r)
    order_waiting(waiting)  # the engine's arrival order, highest priority first
    inst.waiting, inst.running, inst.swapped = waiting, running, swapped
    inst.offloaded = offloaded
    inst.num_waiting_tokens = num_waiting_tokens
    inst.num_free_blocks = num_free_blocks
    live.update(r.req_id for r in inst.pending_in)
    for rid in [rid for rid in reqs if rid not in live]:
        del reqs[rid]
