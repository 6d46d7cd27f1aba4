"""`natsd.free_port`: a port handed out once, or promised with `reserve`, is never handed out."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from services.cli import natsd


def _draws(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> None:
    it: Iterator[int] = iter(ports)
    monkeypatch.setattr(random, "randrange", lambda lo, hi: next(it))


def test_a_reserved_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = natsd.free_port(), natsd.free_port()  # two free ports this process now holds
    monkeypatch.setattr(natsd, "_TAKEN", {a})  # forget b: only a is promised
    natsd.reserve(a)
    _draws(monkeypatch, [a, a, b])  # the draw hits the promised port twice
    assert natsd.free_port() == b


def test_a_port_is_handed_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    first = natsd.free_port()
    other = natsd.free_port()
    _draws(monkeypatch, [first, other])
    monkeypatch.setattr(natsd, "_TAKEN", {first})
    assert natsd.free_port() == other  # the same draw again is skipped, not handed out twice
