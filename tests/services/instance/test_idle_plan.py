"""An idle instance still gives its policy a `schedule` at each idle report, so a policy that asks
for work from there (OOCO's strict instances pull offline decodes) is heard: the report carries
the pull hint although the instance never had a request."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS

from services.common.bus import connect
from services.instance import main as instance_main
from tidal.policy.ooco.steps import PULL_SEQ
from tidal.schemas import codec, subjects
from tidal.schemas.messages import InstanceReport

pytestmark = pytest.mark.nats


async def test_an_idle_strict_instance_reports_that_it_has_room_to_pull(nats_url: str) -> None:
    args = instance_main.parse_args(
        [
            *("--nats-url", nats_url, "--id", "inst-strict", "--index", "1"),
            *("--sim-step-model", "linear:0.02,0,0,0", "--max-model-len", "256"),
            *("--policy", "ooco", "--roles", "relaxed,strict", "--tokenizer", "bytes"),
        ]
    )
    nc: NATS = await connect(nats_url, "test")
    reports: asyncio.Queue[InstanceReport] = asyncio.Queue()

    async def on_report(msg) -> None:  # type: ignore[no-untyped-def]
        await reports.put(codec.decode(msg.data, InstanceReport))

    await nc.subscribe(subjects.instance_state("inst-strict"), cb=on_report)
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(args, stop))
    try:
        seqs: list[float] = []
        for _ in range(8):  # idle reports (every 0.5 s), each after a plan that found room
            rep = await asyncio.wait_for(reports.get(), 10)
            assert rep.role == "strict" and not rep.requests
            if PULL_SEQ in rep.hints:
                seqs.append(rep.hints[PULL_SEQ])
        assert len(seqs) >= 2 and seqs[-1] > seqs[0]
    finally:
        stop.set()
        await task
        await nc.drain()
