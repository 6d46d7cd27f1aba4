"""Kill -9 each part of the stack under mixed load: 32 online streams (the openai client,
`stream=True`) while an offline batch runs through the Batch API (issue 15, item 2).

Each kill has its own `tidal up --engine sim`, which brings the killed child back. Whatever is
killed: the batch completes with every custom_id exactly once; the cluster serves a new request
again (how soon is a figure of `tidal bench faults`, not asserted here). The streams go
alternately through `tidal up`'s gateway-0 and a second gateway: a killed gateway's own clients
get an error, never a hang (the client's own timeout); every other client, whatever was killed
(an instance, the scheduler, the bus, the other gateway), gets one complete answer with no
repeated text.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.fault.conftest import Up
from tidal_bench.faults.kit import Outcome, run_mixed
from tidal_bench.faults.run import KILLS

pytestmark = [pytest.mark.fault, pytest.mark.nats]
STREAMS = 32
MAX_TOKENS = 64


def _check_batch(o: Outcome) -> None:
    assert o.batch_done_at_kill < o.batch_lines, "the batch ended before the kill"
    assert o.batch_status == "completed", (o.batch_status, o.batch_errors)
    assert o.batch_lost == [], (o.batch_lost[:10], o.batch_errors)
    assert o.batch_duplicated == []


@pytest.mark.parametrize("kill", KILLS)
def test_a_kill_under_streams_and_a_batch(up: Up, kill: str) -> None:
    o = asyncio.run(run_mixed(up, kill, streams=STREAMS, max_tokens=MAX_TOKENS))
    print(o.summary())
    _check_batch(o)
    assert o.recovery_s is not None, "no request succeeded after the kill:\n" + up.log_text()
    in_flight = [s for s in o.streams if s.in_flight_at_kill]
    assert in_flight, "every stream ended before the kill"
    for s in o.streams:
        if o.own_client(s) and s.in_flight_at_kill:
            # its own clients: each sees an error, never a hang (the client's own timeout)
            assert s.error and not s.timed_out, s.error
            continue
        assert s.error == "", (s.gateway, s.error)
        assert s.finish == "length", s
        assert s.completion_tokens == MAX_TOKENS, s
        # the sim engine writes one word per token: a repeat would show as extra words
        assert len(s.text.split()) == MAX_TOKENS, s.text
