"""One OpenMP team per process: torch's parallel work on one dedicated thread, one torch thread on
every other.

libgomp (the OpenMP runtime of torch's CPU build) keeps a thread pool for each thread that opens a
parallel region, and counts the threads of all of them. Once that count exceeds the CPUs the
process may run on, the idle threads of *every* pool spin only ~100 times before sleeping on a
futex (libgomp's `gomp_throttled_spin_count_var`), so each of the hundreds of parallel regions of a
decode step pays a futex wake-up, for the rest of the process. Measured on 2 cores: a SmolLM2
batch-1 step on 2 threads took 17.7 ms, and 27.6 ms (no faster than on 1 thread) after a single
2-thread copy had run on another thread. An instance ran its steps on any `asyncio.to_thread`
worker and copied KV on its data-plane threads, so its steps were that slow on the stack.

So a service that computes with torch runs that work on its `ComputeThread` (one thread, the only
one whose torch thread count is above 1) and every other thread keeps one torch thread: the loop's
default executor (`install`) calls `single_torch_thread` before each job, and so do the threads an
instance starts for KV copies (data-plane senders and receivers). A process without
torch imported (a `sim` instance) is untouched.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def single_torch_thread() -> None:
    """Keep the calling thread at one torch thread (no OpenMP pool of its own), if torch is in
    use in this process; cheap when it already is."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


class ComputeThread:
    """One thread for a service's torch work: what `asyncio.to_thread` is for any other blocking
    call. Calls run one at a time, in the order made. A service holds one (an instance for its
    engine, a CPU-attention worker for its attention); a process holding two (tests) has two
    OpenMP pools, and pays for it as the module's docstring says."""

    def __init__(self, name: str = "torch-compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[T]:
        """Queue `fn` behind the calls made before it; await the future for its result. The
        caller goes on meanwhile (the instance plans and publishes while a step computes)."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SingleTorchThreadExecutor(ThreadPoolExecutor):
    """A thread pool whose every job runs with one torch thread (`single_torch_thread` first)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(_single, fn, *args, **kwargs)


def _single(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    single_torch_thread()
    return fn(*args, **kwargs)


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Give `loop` a default executor (what `asyncio.to_thread` uses) of one-torch-thread jobs,
    and keep the loop's own thread at one torch thread. Call it before the first `to_thread`."""
    loop.set_default_executor(SingleTorchThreadExecutor(thread_name_prefix="asyncio"))
    single_torch_thread()
