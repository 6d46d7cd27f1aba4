"""Instance state -> report -> cluster view, and engine snapshots -> instance state."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from tidal.cluster.view import (
    PENDING_IN,
    SUBMITTED,
    build_cluster_view,
    report_of,
    sync_instance,
)
from tidal.engine.api import SeqSnapshot
from tidal.perf.linear import LinearStepModel
from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState, Slo
from tidal.schemas.enums import RequestClass
from tidal.schemas.messages import InstanceReport

MODEL = LinearStepModel()
T0 = 1_700_000_000.0  # Unix seconds
FIELDS = (
    "req_id",
    "req_class",
    "arrival_s",
    "num_prompt_tokens",
    "max_output_tokens",
    "slo",
    "phase",
    "instance_id",
    "num_computed_tokens",
    "num_output_tokens",
    "num_blocks",
    "start_s",
    "first_token_s",
    "last_token_s",
    "max_tbt_s",
    "num_preemptions",
    "num_migrations",
    "priority",
)


def make_request(
    rid: str, phase: Phase, inst: int | None, online: bool = True, **kw: object
) -> ReqState:
    cls = RequestClass.ONLINE if online else RequestClass.OFFLINE
    r = ReqState(rid, cls, T0 + 1, 300, 50, Slo(1.0, 0.05) if online else None)
    r.phase, r.instance_id = phase, inst
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def make_instance(i: int, role: InstanceRole = InstanceRole.AGGREGATED) -> InstanceState:
    return InstanceState(i, role, 512, 64, 16, 100, 100, MODEL, 1000.0, 25e9)


def two_instances() -> tuple[InstanceState, InstanceState]:
    """a: one waiting, one prefilling, one decoding, one swapped, one offloaded, one prefilled
    and waiting for room on b (listed in b.pending_in)."""
    a, b = make_instance(0, InstanceRole.RELAXED), make_instance(1, InstanceRole.STRICT)
    a.waiting.append(make_request("w", Phase.WAITING, 0, online=False))
    a.running.append(
        make_request("p", Phase.RUNNING, 0, num_computed_tokens=128, num_blocks=8, start_s=T0 + 2)
    )
    dec = make_request(
        "d",
        Phase.RUNNING,
        0,
        num_computed_tokens=310,
        num_output_tokens=11,
        num_blocks=20,
        start_s=T0 + 2,
        first_token_s=T0 + 3,
        last_token_s=T0 + 3.5,
        max_tbt_s=0.04,
        num_preemptions=1,
        num_migrations=2,
    )
    a.running.append(dec)
    t = make_request("t", Phase.TRANSFER_WAIT, 0, num_computed_tokens=300, num_output_tokens=1)
    a.running.append(t)
    b.pending_in.append(t)
    a.swapped.append(make_request("s", Phase.SWAPPED, 0, online=False, num_computed_tokens=40))
    a.offloaded.append(make_request("o", Phase.OFFLOADED, 0, online=False, num_output_tokens=3))
    a.num_free_blocks = 72
    a.num_waiting_tokens = 300
    a.busy_until_s = T0 + 4
    a.hints["ooco.pull_seq"] = 3.0
    return a, b


def assert_same(x: InstanceState, y: InstanceState) -> None:
    for name in (
        "instance_id",
        "role",
        "chunk_size",
        "max_batch_reqs",
        "block_size",
        "num_blocks",
        "num_free_blocks",
        "kv_bytes_per_token",
        "num_waiting_tokens",
        "busy_until_s",
        "hints",
    ):
        assert getattr(x, name) == getattr(y, name), name
    for lst in ("waiting", "running", "swapped", "offloaded", "pending_in"):
        xs, ys = getattr(x, lst), getattr(y, lst)
        assert [r.req_id for r in xs] == [r.req_id for r in ys], lst
        for rx, ry in zip(xs, ys, strict=True):
            for f in FIELDS:
                assert getattr(rx, f) == getattr(ry, f), (rx.req_id, f)


def test_round_trip_gives_equal_fields() -> None:
    a, b = two_instances()
    reps = [
        report_of(inst, f"inst-{i}", T0 + 5, 7, step_model="m") for i, inst in enumerate((a, b))
    ]
    phases = {rr.req_id: rr.phase for rr in reps[0].requests}
    assert phases == {
        "w": "waiting",
        "p": "running",
        "d": "running",
        "t": "transfer_wait",
        "s": "swapped",
        "o": "offloaded",
    }
    assert [rr.phase for rr in reps[1].requests] == [PENDING_IN]
    view = build_cluster_view(reps[::-1], {"m": MODEL}, 10e9, num_incoming={1: 2})
    assert [i.instance_id for i in view.instances] == [0, 1]
    assert_same(view.instances[0], a)
    b.num_incoming = 2
    assert_same(view.instances[1], b)
    assert view.instances[1].num_incoming == 2
    # The request waiting for room is one object in both places, owned by its prefill instance.
    assert view.instances[1].pending_in[0] is view.instances[0].running[2]


def test_report_survives_the_wire() -> None:
    a, _ = two_instances()
    rep = report_of(a, "inst-0", T0 + 5, 1, step_model="m")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(rep), type=InstanceReport) == rep


def test_cache_reuses_objects_and_forgets_finished() -> None:
    a, b = two_instances()
    cache: dict[str, ReqState] = {}
    models = {"m": MODEL}
    v1 = build_cluster_view(
        [report_of(a, "a", T0, 1, step_model="m"), report_of(b, "b", T0, 1, step_model="m")],
        models,
        1e9,
        cache=cache,
    )
    d1 = v1.instances[0].running[1]
    a.running[1].num_output_tokens += 1
    del a.waiting[0]
    a.num_waiting_tokens = 0
    v2 = build_cluster_view(
        [report_of(a, "a", T0, 2, step_model="m"), report_of(b, "b", T0, 2, step_model="m")],
        models,
        1e9,
        cache=cache,
    )
    d2 = v2.instances[0].running[1]
    assert d2 is d1 and d2.num_output_tokens == 12
    assert "w" not in cache and v2.instances[0].num_waiting_tokens == 0
    held = ReqState("h", RequestClass.OFFLINE, T0, 10, 10)
    cache["h"] = held
    v3 = build_cluster_view(
        [report_of(a, "a", T0, 3, step_model="m"), report_of(b, "b", T0, 3, step_model="m")],
        models,
        1e9,
        held=[held],
        cache=cache,
    )
    assert v3.held == [held] and cache["h"] is held


def test_slots_must_be_complete_and_models_known() -> None:
    a, _ = two_instances()
    with pytest.raises(ValueError, match="slots"):
        build_cluster_view([report_of(make_instance(1), "b", T0, 1)], {"": MODEL}, 1e9)
    with pytest.raises(ValueError, match="step model"):
        build_cluster_view([report_of(a, "a", T0, 1, step_model="x")], {}, 1e9)


def snap(rid: str, status: str, computed: int = 0, out: int = 0, blocks: int = 0) -> SeqSnapshot:
    return SeqSnapshot(rid, RequestClass.ONLINE, T0, 300, 50, computed, out, blocks, status)


def test_sync_instance_mirrors_the_engine() -> None:
    inst = make_instance(3)
    reqs: dict[str, ReqState] = {}
    slo = Slo(2.0, 0.1)
    sync_instance(
        inst,
        [
            snap("a", "running", 310, 11, 20),
            snap("b", "waiting"),
            snap("c", "swapped", 40),
            snap("o", "offloaded", 300, 5),
        ],
        reqs,
        60,
        slos={"a": slo},
        now=T0 + 9,
    )
    assert [r.req_id for r in inst.running] == ["a"]
    assert [r.req_id for r in inst.waiting] == ["b"]
    assert [r.req_id for r in inst.swapped] == ["c"]
    assert [r.req_id for r in inst.offloaded] == ["o"] and reqs["o"].phase is Phase.OFFLOADED
    assert inst.num_free_blocks == 60 and inst.num_waiting_tokens == 300
    a = reqs["a"]
    assert (a.phase, a.instance_id, a.num_computed_tokens, a.num_output_tokens, a.num_blocks) == (
        Phase.RUNNING,
        3,
        310,
        11,
        20,
    )
    assert a.slo == slo and a.queued_s == T0 + 9 and a.is_decoding
    # Next step: b started (same object), a finished and left the engine; o stays offloaded
    # (on a CPU-attention worker: the engine still reports it).
    b, o = reqs["b"], reqs["o"]
    sync_instance(
        inst, [snap("b", "running", 256, 0, 16), snap("o", "offloaded", 301, 6)], reqs, 50
    )
    assert inst.running == [b] and reqs["b"] is b and b.phase is Phase.RUNNING
    assert inst.offloaded == [o] and o.num_output_tokens == 6
    assert set(reqs) == {"b", "o"} and inst.waiting == [] and inst.swapped == []
    with pytest.raises(ValueError, match="status"):
        sync_instance(inst, [snap("x", "lost")], reqs, 50)


def test_submitted_and_migrating_requests_are_known_but_only_submitted_ones_queue() -> None:
    a, b = two_instances()
    rep = report_of(a, "inst-0", T0 + 5, 7, step_model="m")
    extra = [
        msgspec.structs.replace(rep.requests[0], req_id="sub", phase=SUBMITTED),
        msgspec.structs.replace(rep.requests[0], req_id="mig", phase=Phase.MIGRATING.value),
    ]
    rep = msgspec.structs.replace(rep, requests=[*rep.requests, *extra])
    other = report_of(b, "inst-1", T0 + 5, 7, step_model="m")
    view = build_cluster_view([rep, other], {"m": MODEL}, 10e9)
    waiting = {r.req_id: r for r in view.instances[0].waiting}
    assert waiting["sub"].phase is Phase.WAITING  # queued at its instance, not yet in its engine
    listed = {r.req_id for i in view.instances for lst in (i.waiting, i.running) for r in lst}
    assert "mig" not in listed  # leaving now: in no queue a policy acts on


def test_priorities_are_mirrored_ordered_and_reported() -> None:
    """The engine's arrival order becomes highest priority first in the instance's waiting
    list; the report carries each request's priority to the scheduler's view."""
    inst = make_instance(0)
    reqs: dict[str, ReqState] = {}
    snaps = [
        dataclasses.replace(snap(rid, status, *run), priority=p)
        for rid, status, p, run in (("s1", "waiting", 1, ()), ("i1", "waiting", 2, ()),
                                    ("s2", "waiting", 1, ()), ("r", "running", 1, (310, 11, 20)),
                                    ("i2", "waiting", 2, ()))
    ]  # fmt: skip
    sync_instance(inst, snaps, reqs, 60)
    assert [r.req_id for r in inst.waiting] == ["i1", "i2", "s1", "s2"]
    assert reqs["i1"].priority == 2 and reqs["r"].priority == 1
    view = build_cluster_view([report_of(inst, "a", T0, 1, step_model="m")], {"m": MODEL}, 1e9)
    assert {r.req_id: r.priority for r in view.instances[0].waiting} == {
        "i1": 2, "i2": 2, "s1": 1, "s2": 1
    }  # fmt: skip
    assert view.instances[0].running[0].priority == 1
