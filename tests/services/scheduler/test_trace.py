"""The scheduler's event trace (`TIDAL_SIM_STEP_TRACE_DIR`): reports received and held requests
dispatched, one JSON line each in `scheduler.ndjson` (never `*.jsonl`: the replay reads those as
instance traces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.scheduler.trace import FILE_NAME, EventTrace
from tests.services.scheduler.scheduler_kit import running_scheduler
from tests.services.scheduler.test_scheduler import join, route


def test_event_trace_writes_one_stamped_line_per_event_and_nothing_when_off(
    tmp_path: Path,
) -> None:
    t = EventTrace(str(tmp_path))
    t.write("dispatch", req_id="a", index=0)
    t.close()
    (line,) = (tmp_path / FILE_NAME).read_text().splitlines()
    rec = json.loads(line)
    assert rec["event"] == "dispatch" and rec["req_id"] == "a" and rec["unix_s"] > 0
    off = EventTrace("")
    off.write("dispatch", req_id="a")
    assert not off.is_on and not list(tmp_path.glob("*.jsonl"))


@pytest.mark.nats
async def test_a_held_offline_request_s_dispatch_is_traced(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TIDAL_HEARTBEAT_S", "0.1")
    monkeypatch.setenv("TIDAL_SIM_STEP_TRACE_DIR", str(tmp_path))
    argv = ["--nats-url", nats_url, "--id", "sched-t", "--policy", "online-priority"]
    argv += ["--roles", "prefill,decode"]
    async with running_scheduler(nats_url, argv) as nc:
        await join(nc, "p", 0, "prefill")
        await join(nc, "d", 1, "decode")
        # online-priority holds it, then its tick hands it to the idle prefill instance
        reply = await route(nc, req_class="offline", req_id="off-1")
        assert reply.instance_id == "p", reply
    events = [json.loads(x) for x in (tmp_path / FILE_NAME).read_text().splitlines()]
    (d,) = [e for e in events if e["event"] == "dispatch"]
    assert d["req_id"] == "off-1" and d["index"] == 0 and d["unix_s"] >= d["tick_unix_s"]
    assert {e["index"] for e in events if e["event"] == "report"} == {0, 1}
