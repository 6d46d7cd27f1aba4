"""`tidal up --nats-cluster 3`: the Batch API's streams and buckets have 3 replicas, and kill -9
of the node leading the jobs stream, in the middle of a batch and 16 online streams, loses and
duplicates nothing: the batch completes with every custom_id once, every stream completes, and
the node (restarted by `tidal up`) rejoins and catches up. The figures (restart and catch-up
seconds, recovery) are printed: `pytest tests/fault/test_nats_cluster.py -s`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from services.common.batch_store import FILES_BUCKET, JOBS_STREAM, KV_BUCKETS
from services.common.bus import connect
from tidal_bench.faults.kit import Stack
from tidal_bench.faults.nats import run_node_loss

pytestmark = [pytest.mark.fault, pytest.mark.nats, pytest.mark.slow]
STREAMS = 16
MAX_TOKENS = 64


@pytest.fixture
def cluster() -> Iterator[Stack]:
    stack = Stack("--nats-cluster", "3")
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


async def _replicas(stack: Stack) -> dict[str, int]:
    url = json.loads((stack.tmp / "up.json").read_text())["nats_url"]
    assert len(url.split(",")) == 3  # the services are given every node as a seed
    nc = await connect(url, "test")
    try:
        js = nc.jetstream()
        names = [JOBS_STREAM, f"OBJ_{FILES_BUCKET}", *(f"KV_{b}" for b in KV_BUCKETS)]
        return {n: (await js.stream_info(n)).config.num_replicas for n in names}
    finally:
        await nc.close()


def test_kill_the_jobs_leader_mid_batch_loses_and_duplicates_nothing(cluster: Stack) -> None:
    outcome, node = asyncio.run(run_node_loss(cluster, streams=STREAMS, batch_lines=200))
    print(
        {
            **outcome.summary(),
            "node": node.node,
            "restart_s": node.restart_s,
            "catch_up_s": node.catch_up_s,
        }
    )
    assert outcome.batch_done_at_kill < outcome.batch_lines, "the batch ended before the kill"
    assert outcome.batch_status == "completed", (outcome.batch_status, outcome.batch_errors)
    assert outcome.batch_lost == [] and outcome.batch_duplicated == []
    assert [s for s in outcome.streams if s.in_flight_at_kill], "no stream was in flight"
    for s in outcome.streams:
        assert s.error == "" and s.finish == "length", s
        assert len(s.text.split()) == MAX_TOKENS, s.text  # no token lost or repeated
    assert node.restarted_at is not None, "the node was not restarted"
    assert node.current_at is not None, "the restarted node never caught up:\n" + cluster.log_text()
    # every stream and bucket still has its 3 copies
    assert set(asyncio.run(_replicas(cluster)).values()) == {3}
