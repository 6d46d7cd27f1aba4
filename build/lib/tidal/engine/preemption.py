"""The layer-boundary preemption signal both engines share (OOCO §3.4.1).

A step runs inside `with signal.step():`; another thread calls `request()` while it runs, and
the step checks `is_set()` (or sleeps in `wait()`) between layers and stops at the next
boundary. `latency_s()` is the time from the request to that moment.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class LayerPreemption:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._in_step = False
        self._requested_at = 0.0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark a step as running (a request outside one is refused), the signal cleared."""
        with self._lock:
            self._in_step = True
            self._event.clear()
        try:
            yield
        finally:
            with self._lock:
                self._in_step = False

    @property
    def in_step(self) -> bool:
        """A step is running now."""
        return self._in_step

    def request(self) -> bool:
        """Thread-safe: ask the running step to stop after its current layer; False if no step
        is running."""
        with self._lock:
            if not self._in_step:
                return False
            self._requested_at = time.perf_counter()
            self._event.set()
            return True

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`, waking early (True) when preemption is requested."""
        return self._event.wait(timeout_s)

    def latency_s(self) -> float:
        """Seconds since the last request (call it when the step has stopped)."""
        return time.perf_counter() - self._requested_at
