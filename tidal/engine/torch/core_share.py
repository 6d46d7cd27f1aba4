"""Cores shared by the engines on one machine, following the load (issue 17, item 4).

`tidal up` runs several instances on one machine. A fixed split (cores ÷ instances threads each)
leaves a lone stream on a fraction of the cores while the other instances idle. Instead each
engine holds one slot of a small shared file (`CoreShare`): before a step it stamps its slot
"busy until" a moment ahead and runs that step on `cores // busy engines` threads; with no work
it clears the slot. A slot whose engine died expires by itself. Races are benign: an engine that
misses a neighbour's stamp by one step oversubscribes for that step only.

NOTE: oversubscribing is what this must avoid, not merely idle cores: an OpenMP step whose
threads outnumber the free cores waits at every op's barrier for a descheduled thread (a 15 ms
SmolLM2 step measured 40-400 ms with 2 threads beside another busy process on 2 cores).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

_SLOT = struct.Struct("d")  # busy-until, time.monotonic() seconds (0 = idle)
# A busy stamp outlives the step by this much, or by 3 steps if longer: back-to-back steps renew
# it long before it lapses, and an engine whose last request left without a step of its own
# (migrated, aborted) hands its cores back this soon.
MIN_TTL_S = 0.1


def create(path: Path, num_slots: int) -> None:
    """A fresh shared file of `num_slots` idle slots (by `tidal up`, before the instances)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(b"\0" * (_SLOT.size * num_slots))
    os.replace(tmp, path)


class CoreShare:
    def __init__(self, path: Path, index: int, cores: int | None = None) -> None:
        # The cores this process may run on (a `--cores` pin), not the machine's.
        self.cores = cores or len(os.sched_getaffinity(0)) or 1
        self._f = open(path, "r+b")  # noqa: SIM115 - mapped for the engine's lifetime
        self._m = mmap.mmap(self._f.fileno(), 0)
        self.num_slots = len(self._m) // _SLOT.size
        if not 0 <= index < self.num_slots:
            raise ValueError(f"slot {index} outside the {self.num_slots} of {path}")
        self.index = index
        self.last_threads = 0

    def _busy_count(self, now: float) -> int:
        return sum(
            1 for i in range(self.num_slots) if _SLOT.unpack_from(self._m, i * _SLOT.size)[0] > now
        )

    def busy(self, step_s: float = 0.0) -> int:
        """Stamp this engine busy; the threads its next step should use."""
        now = time.monotonic()
        _SLOT.pack_into(self._m, self.index * _SLOT.size, now + max(MIN_TTL_S, 3 * step_s))
        return max(1, self.cores // max(1, self._busy_count(now)))

    def idle(self) -> None:
        _SLOT.pack_into(self._m, self.index * _SLOT.size, 0.0)

    def apply(self, step_s: float = 0.0) -> int:
        """`busy()`, and set torch's threads to it in the calling thread (cheap unchanged).

        NOTE: the count is per thread: with OpenMP, `torch.set_num_threads` sets the calling
        thread's ICV only. When the instance stepped on whichever `asyncio.to_thread` worker was
        free, comparing with a cached count set the first worker only, so a lone stream's steps
        ran on one thread whenever another worker took them (measured: 28 ms inter-token). It
        now steps on one compute thread (`services.common.torch_threads`); the check stays, as
        any caller may step from any thread."""
        import torch  # here: `tidal up` creates the file without importing torch

        n = self.busy(step_s)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        self.last_threads = n
        return n

    def close(self) -> None:
        self.idle()
        self._m.close()
        self._f.close()
