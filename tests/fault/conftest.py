"""A running `tidal up --engine sim` that a test may kill parts of (kill -9); `tidal up` brings
each killed child back. The abuse tests' shared stack (`fuzz_up`, `http`) is in fuzzkit.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fault.fuzzkit import fuzz_up, http
from tidal_bench.faults.kit import MODEL, Stack

__all__ = ["MODEL", "Up", "fuzz_up", "http", "up"]


class Up(Stack):
    """The stack a fault test kills parts of (see `tidal_bench.faults.kit.Stack`)."""


@pytest.fixture
def up() -> Iterator[Up]:
    stack = Up()
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()
