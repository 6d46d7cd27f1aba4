"""The background copier of offline KV checkpoints (ConServe): full KV blocks copied from the
paged pool to host memory while the engine's next step computes.

The engine queues a `CopyJob` (one request's token range, its pool slots resolved at queue
time) and goes on; one worker thread takes the jobs in order and copies them. On CUDA it copies
on a side stream after an event recorded on the engine's stream when the job was queued (the
KV written by the steps before it is complete), into pinned host memory, and waits for that
copy before it marks the job done; on a CPU engine it is a plain `index_select` off the pool,
on the cores the step uses. (NOTE: the worker leaves torch's thread count alone: under OpenMP
`torch.set_num_threads` in one thread also sets the count of every thread started later.) The
thread exits when the queue is empty and starts again with the next job: an idle engine holds
no thread.

Safety: a full block's KV never changes while its request holds it, so the copy may run beside
a step that writes other slots of the same pool. The engine must not free (and so let the
allocator reuse) a block while a copy reads it: it calls `settle(jobs)` first, which cancels
the jobs not started and waits for the one under way. Job state changes under the copier's
lock; only the engine's thread reads a job's `result` (after `state` is DONE).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["CheckpointCopier", "CopyJob", "JobState"]


class JobState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class CopyJob:
    """Tokens [start, end) of one request's KV, from pool `slots` to a host tensor."""

    start: int
    end: int
    slots: torch.Tensor  # (end - start,) int64, on the host
    nbytes: int  # host bytes reserved for it in the checkpoint budget
    ready: torch.cuda.Event | None = None  # CUDA: the KV is written once this event passes
    state: JobState = JobState.PENDING
    result: torch.Tensor | None = None  # (L, 2, end - start, Hk, D) on the host, once DONE
    error: BaseException | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class CheckpointCopier:
    """One worker thread copying queued jobs in order (see the module docstring)."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self._cuda = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=kv.device) if self._cuda else None
        self._cond = threading.Condition()
        self._queue: deque[CopyJob] = deque()
        self._thread: threading.Thread | None = None
        self.paused = False  # tests: hold the worker before its next job (`resume()`)
        self.busy_s = 0.0  # seconds spent copying, in all (the worker's or `copy_now`'s)

    def submit(self, job: CopyJob) -> None:
        if self._cuda:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(self.kv.device))
        with self._cond:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="tidal-kv-checkpoint", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def copy_now(self, job: CopyJob) -> None:
        """The synchronous path: copy `job` on the caller's thread (and stream), done."""
        start = time.perf_counter()
        out = self.kv.index_select(2, job.slots.to(self.kv.device)).to("cpu")
        if out.data_ptr() == self.kv.data_ptr():  # NOTE: never a view of the pool
            out = out.clone()
        job.result = out
        job.state = JobState.DONE
        self.busy_s += time.perf_counter() - start

    def settle(self, jobs: Iterable[CopyJob]) -> None:
        """Cancel those of `jobs` not started, and wait for the one under way (if any)."""
        jobs = list(jobs)
        with self._cond:
            for job in jobs:
                if job.state is JobState.PENDING:
                    job.state = JobState.CANCELLED
                    self._queue.remove(job)
            self._cond.notify_all()  # a paused worker with nothing left exits
            while any(job.state is JobState.RUNNING for job in jobs):
                self._cond.wait()

    def wait(self, jobs: Iterable[CopyJob]) -> None:
        """Wait until every one of `jobs` is done or cancelled (the worker copies them)."""
        jobs = list(jobs)
        with self._cond:
            self.paused = False
            self._cond.notify_all()
            while any(j.state in (JobState.PENDING, JobState.RUNNING) for j in jobs):
                self._cond.wait()

    def pause(self) -> None:
        with self._cond:
            self.paused = True

    def resume(self) -> None:
        with self._cond:
            self.paused = False
            self._cond.notify_all()

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def _work(self) -> None:
        while True:
            with self._cond:
                while self.paused and self._queue:
                    self._cond.wait()
                if not self._queue:
                    self._thread = None  # exits; the next submit starts another
                    return
                job = self._queue.popleft()
                job.state = JobState.RUNNING
            start = time.perf_counter()
            try:
                result, error = self._copy(job), None
            except BaseException as exc:  # surfaced on the engine's thread (`CopyJob.error`)
                result, error = None, exc
            with self._cond:
                self.busy_s += time.perf_counter() - start
                job.result, job.error = result, error
                job.state = JobState.DONE
                self._cond.notify_all()

    def _copy(self, job: CopyJob) -> torch.Tensor:
        if not self._cuda:
            out = self.kv.index_select(2, job.slots)  # a copy off the pool
            if out.data_ptr() == self.kv.data_ptr():  # NOTE: never a view of the pool
                out = out.clone()
            return out
        assert self._stream is not None and job.ready is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(job.ready)
            idx = job.slots.to(self.kv.device, non_blocking=True)
            dev = self.kv.index_select(2, idx)
            host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
            host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # `dev` and `idx` stay alive until the copy has read them
        return host
