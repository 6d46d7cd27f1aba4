"""Every control message Tidal sends over NATS (what `tidal ctl` and the scheduler send to steer
the cluster), as typed structs. Nothing else lives here.

Control messages travel as JSON (`tidal.schemas.codec.encode_json`) so a person can type them with
the NATS CLI; the data messages are in `tidal.schemas.messages`. Subject names are built by
`tidal.schemas.subjects`.
"""

from __future__ import annotations

from typing import Any

import msgspec


class CtlOfflineAdmission(msgspec.Struct, frozen=True):
    """Reply to `tidal.ctl.offline.pause|resume`."""

    offline_paused: bool


class CtlError(msgspec.Struct, frozen=True):
    error: str


class CtlPolicy(msgspec.Struct, frozen=True):
    """`tidal.ctl.policy` reply, and `tidal.ctl.policy.set` request (fields left out keep their
    value): the policy every half runs, its params, and the default online SLO."""

    policy: str = ""
    params: dict[str, Any] | None = None  # the policy's own config section
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None


class CtlRoles(msgspec.Struct, frozen=True):
    """`tidal.ctl.roles`: set instance roles and chunk sizes (TaiChi's sliders R_PD, S_p, S_d
    are these: how many instances are P-heavy, and each kind's chunk)."""

    roles: dict[str, str] = {}  # instance id -> role
    chunk_sizes: dict[str, int] = {}  # instance id -> tokens per step


class CtlDrain(msgspec.Struct, frozen=True):
    """`tidal.ctl.drain`: take no new work on the instance; its running requests migrate away
    (or finish) and it can then be stopped."""

    instance_id: str
    undrain: bool = False


class CtlPreempt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`tidal.inst.<id>.preempt` (JSON request/reply, from the scheduler or a person): free KV
    on the instance now by preempting offline work at its next step boundary. Name the requests
    (`req_ids`), or ask for `num_blocks` KV blocks and the instance picks offline victims
    (checkpointed ones first, then the latest arrivals). With `below_priority`, online work of
    a request class whose priority is below it may go too (after the offline work: lowest
    priority first, then the latest arrivals); without it online work is never preempted."""

    req_ids: list[str] = []  # these running offline requests (or lower-class online ones)
    req_class: str = "offline"  # the class to preempt from; only "offline" is allowed
    num_blocks: int = 0  # with no req_ids: free at least this many KV blocks, else nothing
    swap: bool = False  # an offline victim without a checkpoint is swapped to host memory
    # (nothing lost; for policies that swap requests back in) instead of recomputed
    below_priority: int | None = None  # online requests of a class priority below this may
    # be preempted too, by recompute (None: offline work only)


class Preempted(msgspec.Struct, frozen=True):
    """One request a `CtlPreempt` preempted."""

    req_id: str
    how: str  # "release" (checkpointed: blocks freed, no copy) | "swap" | "recompute"
    tokens_lost: int  # tokens whose KV was dropped and will be computed again


class CtlPreemptReply(msgspec.Struct, frozen=True):
    """The answer to a `CtlPreempt`: what was freed, or why nothing was (`error`)."""

    freed_blocks: int = 0  # KV blocks free after minus before
    preempted: list[Preempted] = []
    num_free_blocks: int = 0  # KV blocks free on the instance afterwards
    free_ms: float = 0.0  # the signal's arrival -> the blocks free (the boundary wait included)
    boundary_ms: float = 0.0  # of free_ms, the wait for the step boundary (the engine lock)
    error: str = ""  # non-empty: nothing was preempted, and this says why
