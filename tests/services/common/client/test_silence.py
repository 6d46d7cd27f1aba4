"""`services/common/client/silence.py`: an instance unheard for seconds, then heard again, marks its
streams' gaps as final and asks for a check against its next report; a late beat does not."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from services.common.client.silence import ABANDONED_KEEP_S, Silences


def test_a_silence_longer_than_the_bound_is_noted_once_heard_again() -> None:
    backs: list[str] = []
    s = Silences(heartbeat_s=0.5, on_back=lambda _, iid: backs.append(iid))
    assert s.silence_s == 2.0  # 4 beats of 0.5 s, at least 2 s
    s.heard("i0", 10.0)
    s.heard("i0", 11.9)  # late beats: not a silence
    assert backs == [] and not s.was_silent_since("i0", 0.0)
    s.heard("i0", 20.0)  # 8 s unheard: a cut
    assert backs == ["i0"]
    assert s.was_silent_since("i0", 15.0) and not s.was_silent_since("i0", 20.0)
    assert not s.was_silent_since("i1", 0.0)


def test_abandoned_ids_are_kept_for_a_while_then_dropped() -> None:
    s = Silences(heartbeat_s=0.5, on_back=lambda *_: None)
    s.abandon("r1", 0.0)
    s.abandon("r2", ABANDONED_KEEP_S + 1)
    assert set(s.abandoned) == {"r2"}


def test_an_abandoned_copy_still_reported_is_cancelled_again_at_most_once_a_second() -> None:
    s = Silences(heartbeat_s=0.5, on_back=lambda *_: None)
    s.abandon("r1", 0.0)
    rep: Any = SimpleNamespace(requests=[SimpleNamespace(req_id="r1"), SimpleNamespace(req_id="x")])
    assert s.still_running(rep, 5.0) == ["r1"]
    assert s.still_running(rep, 5.1) == []  # the burst of reports a cut instance flushes
    assert s.still_running(rep, 6.2) == ["r1"]


def test_an_instance_unheard_for_a_silence_is_silent_and_a_send_around_it_met_a_cut() -> None:
    s = Silences(heartbeat_s=0.5, on_back=lambda *_: None)
    assert not s.is_silent("i0", 100.0)  # never heard: nothing known of it
    s.heard("i0", 10.0)
    assert not s.is_silent("i0", 11.0) and s.is_silent("i0", 12.5)
    assert s.was_cut_around("i0", 12.0, 12.5)  # sent while it was silent
    s.heard("i0", 30.0)  # back
    assert not s.is_silent("i0", 30.5)
    assert s.was_cut_around("i0", 31.0, 36.0)  # sent just after it came back
    for t in range(31, 60):  # beats again
        s.heard("i0", float(t))
    assert not s.was_cut_around("i0", 60.0, 61.0)  # long after: a timeout is its own


def test_until_heard_waits_for_a_silent_instance_and_gives_up_at_its_bound() -> None:
    async def go() -> None:
        s = Silences(heartbeat_s=0.5, on_back=lambda *_: None)
        assert await s.until_heard("never-heard", 5.0)
        s.heard("i0", time.monotonic() - 10.0)
        asyncio.get_running_loop().call_later(0.3, s.heard, "i0")
        t0 = time.monotonic()
        assert await s.until_heard("i0", 5.0)
        assert 0.25 < time.monotonic() - t0 < 2.0
        s.heard("i1", time.monotonic() - 10.0)
        assert not await s.until_heard("i1", 0.3)

    asyncio.run(go())
