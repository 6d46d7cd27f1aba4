"""Core pinning: a service runs on the cores it is given, with as many torch threads.

A core list is written as Linux's `taskset -c` / cpuset lists are: `0`, `0-3,6`. `parse_cores`
checks it against the cores this process may run on (`os.sched_getaffinity`), `check_disjoint`
that the engine and the CPU-attention workers share none, and `apply` pins every thread of this
process there, sets torch's intra-op threads to the number of cores (and inter-op threads to 1
where torch still allows it) and `OMP_NUM_THREADS` / `MKL_NUM_THREADS` for children.

NOTE: `os.sched_setaffinity(0, ...)` pins only the calling thread; threads already running (an
OpenMP pool, `asyncio.to_thread` workers) keep their old mask. `apply` therefore pins each task in
`/proc/self/task`, and new threads inherit the mask from whichever thread creates them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def allowed_cores() -> frozenset[int]:
    """The cores this process may run on now."""
    return frozenset(os.sched_getaffinity(0))


def format_cores(cores: Iterable[int]) -> str:
    """`{0, 1, 2, 5}` -> `0-2,5` (the form `parse_cores` reads)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cores)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_cores(
    spec: str, what: str = "cores", allowed: Iterable[int] | None = None
) -> tuple[int, ...]:
    """`"0-3,6"` -> (0, 1, 2, 3, 6), sorted, no repeats. ValueError, naming `what` (the flag), for
    an empty list, bad syntax, a reversed range, or a core outside `allowed` (default: the cores
    this process may run on)."""
    ok = frozenset(allowed_cores() if allowed is None else allowed)
    if not spec.strip():
        raise ValueError(f"{what} is empty; give cores as 0 or 0-3,6")
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise ValueError(
                f"{what} {spec!r}: {part!r} is not a core or a range (give 0 or 0-3,6)"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{what} {spec!r}: {part!r} is not a range of cores (low-high)")
        cores.update(range(lo, hi + 1))
    if missing := cores - ok:
        raise ValueError(
            f"{what} {spec!r}: core(s) {format_cores(missing)} not available here "
            f"(this process may run on {format_cores(ok)})"
        )
    return tuple(sorted(cores))


def check_disjoint(**named: Iterable[int]) -> None:
    """ValueError naming the first two core sets (by keyword: the flags) that share a core."""
    seen: list[tuple[str, frozenset[int]]] = []
    for name, cores in named.items():
        mine = frozenset(cores)
        for other, theirs in seen:
            if shared := mine & theirs:
                raise ValueError(
                    f"{other} and {name} share core(s) {format_cores(shared)}; "
                    "they must be disjoint"
                )
        seen.append((name, mine))


def _task_ids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/task"):
            yield int(name)


def pin(cores: Iterable[int]) -> None:
    """Pin every thread of this process (and so each thread it starts later) to `cores`."""
    mask = set(cores)
    os.sched_setaffinity(0, mask)
    for tid in _task_ids():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, mask)


def thread_env(num_threads: int) -> dict[str, str]:
    """The environment that sizes a child's OpenMP / MKL pools (read when torch loads)."""
    return dict.fromkeys(THREAD_ENV, str(num_threads))


def apply(cores: Iterable[int], threads: int = 0) -> int:
    """Pin this process to `cores` and size its thread pools to them (`threads`: this many
    instead, e.g. a share of the cores); returns the torch thread count set."""
    mask = tuple(sorted(set(cores)))
    if not mask:
        raise ValueError("no cores to pin to")
    pin(mask)
    n = threads or len(mask)
    os.environ.update(thread_env(n))
    if "torch" in sys.modules or _has_torch():
        import torch

        torch.set_num_threads(n)
        # Inter-op threads can be set only before torch's first parallel work; later it raises.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
    return n


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def split_cores(cores: Iterable[int], n: int) -> list[tuple[int, ...]]:
    """`n` workers' cores out of `cores`: near-equal disjoint slices when there are at least `n`
    cores, else every worker on all of them (they then share, and should run one thread each)."""
    mask = sorted(set(cores))
    if n <= 0:
        return []
    if len(mask) < n:
        return [tuple(mask)] * n
    base, extra = divmod(len(mask), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(tuple(mask[start : start + size]))
        start += size
    return out


def apply_spec(spec: str, threads: int = 0, what: str = "--cores") -> tuple[int, ...]:
    """A service's `--cores SPEC`: parse and `apply` it; () and nothing done for an empty spec."""
    if not spec:
        return ()
    cores = parse_cores(spec, what)
    apply(cores, threads)
    return cores
