"""How busy the other processes on this machine are: CPU time the whole machine spent (Linux's
`/proc/stat`) less this process's own (`os.times`), in cores, over a window.

The dtype calibration (`dtype_choice`) times matmuls; whatever else runs meanwhile skews the
ratios (a loaded run once cached fp32 without its bf16 copies on an AVX2 CPU, 3x slower at batch
1, for good). It records how busy the others were while it measured, and a later start re-measures
a loaded result once the machine is quiet. Where `/proc/stat` cannot be read, the others count as
idle (the calibration then caches as it always did).
"""

from __future__ import annotations

import os
import time

# a calibration measured beside more than this many cores of other work is re-measured when quiet
LOADED_CORES = 0.3
QUIET_CORES = 0.15  # "quiet": the others used under this many cores over `QUIET_WINDOW_S`
QUIET_WINDOW_S = 0.25


def _machine_busy_s() -> float | None:
    """Seconds of CPU time the machine has spent busy since boot (all cores), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    ticks = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


class OthersMeter:
    """Started at construction; `cores()` is the others' average cores busy since then."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), _machine_busy_s(), _own_s()

    def cores(self) -> float:
        busy = _machine_busy_s()
        wall = time.monotonic() - self.t0
        if busy is None or self.busy0 is None or wall <= 0:
            return 0.0
        return max(0.0, (busy - self.busy0) - (_own_s() - self.own0)) / wall


def others_busy_now(window_s: float = QUIET_WINDOW_S) -> float:
    """The others' cores busy over the next `window_s` seconds (this process sleeps)."""
    meter = OthersMeter()
    time.sleep(window_s)
    return meter.cores()
