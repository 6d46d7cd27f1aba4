"""StreamResync on hand-built reports: which open streams a bus outage cut."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.common.client import resync
from services.common.client.resync import StreamResync
from tests.services.scheduler.test_scheduler import make_report
from tidal.schemas.messages import ReqReport


@dataclass
class S:
    instance_id: str
    is_finished: bool = False
    progress_unix_s: float = 0.0


def _shown(rid: str) -> ReqReport:
    return ReqReport(rid, "online", "running", 0.0, 10, 4, 10, 1, 1)


async def test_a_stream_its_instance_no_longer_has_after_an_outage_is_run_again(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setattr(resync, "REPORT_AFTER_S", 0.0)
    streams = {"gone": S("i0"), "alive": S("i0"), "done": S("i0", is_finished=True)}
    cut: list[tuple[object, str]] = []
    r = StreamResync(None, streams, lambda s, why: cut.append((s, why)))  # type: ignore[arg-type]
    since = time.time()
    stale = make_report("i0", 0, "relaxed")  # from before the outage: proves nothing
    r.on_report(stale.__class__(**{**{f: getattr(stale, f) for f in stale.__struct_fields__},
                                   "sent_unix_s": since - 5, "requests": []}))  # fmt: skip
    check = asyncio.create_task(r.check(since))
    await asyncio.sleep(0.3)
    assert not check.done() and cut == []  # waits for a report made after the outage
    fresh = make_report("i0", 0, "relaxed", seq=9, requests=[_shown("alive")])
    r.on_report(fresh)
    assert await asyncio.wait_for(check, 5) == 1
    assert cut == [(streams["gone"], "its stream was cut by a bus outage")]


def test_a_stream_silent_for_long_that_its_instance_no_longer_shows_is_run_again() -> None:
    now = 1000.0
    streams = {
        "gone": S("i0", progress_unix_s=now - 20),  # lost (say, mid-migration with its source)
        "quiet": S("i0", progress_unix_s=now - 20),  # waiting on the instance: still shown
        "recent": S("i0", progress_unix_s=now - 1),  # not silent long enough
        "unseen": S("i1", progress_unix_s=now - 20),  # no report from i1 since: proves nothing
        # routed to i0, not yet acked (i0 still tokenising its long prompt): `place` owns it
        "placing": S("i0", progress_unix_s=0.0),
    }
    cut: list[object] = []
    r = StreamResync(None, streams, lambda s, why: cut.append(s))  # type: ignore[arg-type]
    rep = make_report("i0", 0, "relaxed", seq=3, requests=[_shown("quiet")])
    r.on_report(rep.__class__(**{**{f: getattr(rep, f) for f in rep.__struct_fields__},
                                 "sent_unix_s": now - 0.5}))  # fmt: skip
    assert r.sweep(now) == 1 and cut == [streams["gone"]]
    assert r.sweep(now + 1) == 0  # once per stall
