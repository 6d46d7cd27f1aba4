"""Threads that follow the load across the engines of one machine (`tidal up`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engine.api import EngineRequest, SamplingParams
from tidal.engine.torch import core_share


def test_threads_follow_who_is_busy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cores.bin"
    core_share.create(path, 2)
    a = core_share.CoreShare(path, 0, cores=4)
    b = core_share.CoreShare(path, 1, cores=4)
    assert a.busy() == 4  # alone: every core
    assert b.busy() == 2 and a.busy() == 2  # both busy: half each
    b.idle()
    assert a.busy() == 4
    monkeypatch.setattr(core_share, "MIN_TTL_S", 0.05)
    b.busy()
    time.sleep(0.1)  # b died mid-step: its stamp expires
    assert a.busy() == 4
    with pytest.raises(ValueError, match="slot 2"):
        core_share.CoreShare(path, 2)
    a.close()
    b.close()


def _engine_beside_another(
    make_engine: Any, tmp_path: Path, max_tokens: int
) -> tuple[Any, core_share.CoreShare]:
    """An engine in slot 0 of a 2-core share with one request added, and slot 1's share."""
    path = tmp_path / "cores.bin"
    core_share.create(path, 2)
    other = core_share.CoreShare(path, 1, cores=2)
    engine = make_engine("llama")
    engine.core_share = core_share.CoreShare(path, 0, cores=2)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    engine.add(EngineRequest("a", [1, 2, 3], sp))
    return engine, other


def test_engine_takes_the_cores_while_busy_and_frees_its_slot(
    make_engine: Any, tmp_path: Path
) -> None:
    engine, other = _engine_beside_another(make_engine, tmp_path, max_tokens=3)
    engine.step()
    assert torch.get_num_threads() == 2 and other.busy() == 1  # both busy now
    engine.step()
    assert torch.get_num_threads() == 1
    other.idle()
    while engine.has_work():
        engine.step()
    assert other.busy() == 2  # the engine ran out of work and cleared its slot


def test_apply_sets_the_threads_of_whichever_thread_steps(tmp_path: Path) -> None:
    # the instance steps on any free asyncio.to_thread worker: each must get the count
    core_share.create(tmp_path / "cores", 2)
    share = core_share.CoreShare(tmp_path / "cores", 0, cores=2)
    before = torch.get_num_threads()
    seen: list[int] = []

    def step() -> None:
        torch.set_num_threads(1)  # a worker that last ran with another count
        share.apply()
        seen.append(torch.get_num_threads())

    try:
        share.apply()
        for _ in range(2):
            th = threading.Thread(target=step)
            th.start()
            th.join()
        assert seen == [2, 2]
    finally:
        torch.set_num_threads(before)
        share.close()


def test_a_fixed_thread_count_reaches_whichever_thread_steps(make_engine: Any) -> None:
    # `--fixed-threads --num-threads N`: no core share; each stepping worker gets N, not only the
    # thread that loaded the engine
    engine = make_engine("llama")
    engine.num_threads = 1
    engine.add(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0)))
    seen: list[int] = []

    def step() -> None:
        torch.set_num_threads(2)  # a worker that last ran with another count
        engine.step()
        seen.append(torch.get_num_threads())

    for _ in range(2):
        th = threading.Thread(target=step)
        th.start()
        th.join()
    assert seen == [1, 1]


def test_exporting_the_last_request_frees_the_slot_at_once(
    make_engine: Any, tmp_path: Path
) -> None:
    # a prefill instance whose request leaves for a decode instance: the decoder gets every core
    # from its first step, not after the prefiller's busy stamp (3 prefill steps) lapses
    engine, decoder = _engine_beside_another(make_engine, tmp_path, max_tokens=8)
    engine.step()
    assert decoder.busy() == 1  # the prefiller still counts as busy
    engine.begin_export("a")
    assert decoder.busy() == 2
    engine.end_export("a", True)
