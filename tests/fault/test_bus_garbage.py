"""Garbage on the bus: random bytes and wrong-typed MessagePack/JSON on every NATS subject the
services listen on, and garbage values in the batch KV buckets, are logged and dropped; every
service is still up (the same processes) and serving afterwards. One `tidal up --engine sim`
for the module (`tests/fault/fuzzkit.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import httpx
import msgspec
import nats
import pytest

from tests.fault.fuzzkit import (
    CHAT,
    MODEL,
    FuzzUp,
    assert_openai_error,
    assert_serving,
    upload,
    wait_batch,
)
from tidal.schemas import subjects

pytestmark = [pytest.mark.fault, pytest.mark.nats]


def test_garbage_in_the_batch_kv_buckets_is_skipped(fuzz_up: FuzzUp, http: httpx.Client) -> None:
    async def write() -> None:
        nc = await nats.connect(fuzz_up.nats_url)
        js = nc.jetstream()
        await js.publish("$KV.tidal-batches.batch_garbage", b"\xff\x00 not json")
        await js.publish("$KV.tidal-batch-results.batch_garbage.x", b"[1, 2")
        await nc.drain()

    asyncio.run(write())
    r = http.get("/v1/batches")
    assert r.status_code == 200, r.text
    assert "batch_garbage" not in {b["id"] for b in r.json()["data"]}
    assert_openai_error(http.get("/v1/batches/batch_garbage"), 404)
    assert_openai_error(http.post("/v1/batches/batch_garbage/cancel"), 404)


# -- garbage on the bus --------------------------------------------------------------------------


def _garbage(rng: random.Random) -> list[bytes]:
    """Random bytes, MessagePack and JSON of the wrong shape or types."""
    enc = msgspec.msgpack.encode
    return [
        b"",
        rng.randbytes(1),
        rng.randbytes(64),
        rng.randbytes(4096),
        b"\xc1",  # never used in MessagePack
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 G items
        enc(None),
        enc(7),
        enc("req"),
        enc([1, 2, 3]),
        enc({"req_id": 5, "model": [], "sampling": "x", "reply_subject": None}),
        enc({"instance_id": {"a": 1}, "req_id": 1.5, "seq": "x"}),
        enc({"service_id": "x", "kind": "instance", "pid": -1, "started_unix_s": "now"}),
        enc(
            {
                "req_id": "r",
                "model": "tidal-sim",
                "req_class": "online",
                "max_tokens": -5,
                "num_prompt_chars": -1,
                "ttft_slo_ms": -1.0,
                "tpot_slo_ms": 0.0,
            }
        ),
        b'{"policy": 5}',
        b'{"roles": "x", "chunk_sizes": [1]}',
        b'{"instance_id": 7}',
        b"[1, 2",
        b"\xff\xfe",
        b"null",
        b"[]",
    ]


def _subjects(pids: dict[str, int]) -> list[str]:
    instances = [i for i in pids if i.startswith("instance-")]
    out = [
        subjects.ROUTE,
        subjects.MODELS,
        subjects.CANCEL,
        subjects.INSTANCE_DOWN,
        subjects.MIGRATION_EVENTS,
        subjects.BATCH_STATS,
        subjects.CTL_POLICY_CHANGED,
        subjects.CTL_STATUS,
        subjects.CTL_POLICY,
        subjects.CTL_POLICY_SET,
        subjects.CTL_ROLES,
        subjects.CTL_DRAIN,
        subjects.CTL_OFFLINE_RESUME,
        subjects.gateway_tokens("gateway-0"),
        subjects.BATCH_JOBS + ".batch_garbage",
    ]
    for kind, sid in (
        ("scheduler", "scheduler-0"),
        ("instance", "instance-0"),
        ("gateway", "gateway-0"),
        ("batch", "batch-0"),
    ):
        out.append(subjects.heartbeat(kind, sid))
    for iid in instances:
        out += [
            subjects.instance_submit(iid),
            subjects.instance_state(iid),
            subjects.instance_migrate(iid),
            subjects.instance_control(iid),
            subjects.migrate_offer(iid),
            subjects.migrate_commit(iid),
            subjects.migrate_abort(iid),
        ]
    return out


def test_garbage_on_every_subject_is_dropped_and_every_service_stays_up(
    fuzz_up: FuzzUp, http: httpx.Client
) -> None:
    pids = fuzz_up.pids()
    assert {"scheduler-0", "gateway-0", "batch-0", "instance-0", "instance-1"} <= set(pids)
    rng = random.Random(15)
    subs = _subjects(pids)

    async def feed() -> int:
        nc = await nats.connect(fuzz_up.nats_url)
        sent = 0
        try:
            for subject in subs:
                for payload in _garbage(rng):
                    # A request too, so request/reply handlers see it with a reply subject;
                    # a handler may answer an error or drop it: both are fine.
                    await nc.publish(subject, payload)
                    with contextlib.suppress(nats.errors.TimeoutError):
                        await nc.request(subject, payload, timeout=0.05)
                    sent += 2
            await nc.flush()
        finally:
            await nc.drain()
        return sent

    sent = asyncio.run(feed())
    assert sent >= len(subs) * 20
    time.sleep(1.0)  # heartbeats go on; a crashed child would be gone from status by now
    assert_serving(fuzz_up, http, pids)
    log = fuzz_up.log()
    assert "dropped malformed message" in log
    assert "Traceback" not in log, log[-6000:]
    # a batch still runs end to end (the dispatcher dropped the garbage job)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    file_id = upload(http, json.dumps(line).encode())
    r = http.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert wait_batch(http, r.json()["id"])["status"] == "completed"
