"""`services.common.torch_threads`: torch's parallel work on one thread per service, one torch
thread on every other (libgomp throttles every pool once a process holds more pool threads than
it has CPUs; see the module)."""

from __future__ import annotations

import asyncio
import threading

import torch

from services.common import torch_threads


def test_a_compute_thread_runs_every_call_on_one_thread_in_order() -> None:
    compute = torch_threads.ComputeThread("t")
    seen: list[tuple[int, int]] = []

    async def main() -> int:
        await asyncio.gather(
            *(compute.run(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(8))
        )
        return await compute.run(threading.get_ident)

    try:
        ident = asyncio.run(main())
        assert [i for i, _ in seen] == list(range(8))
        assert {t for _, t in seen} == {ident} != {threading.get_ident()}
    finally:
        compute.close()


def test_installed_loop_runs_to_thread_jobs_on_one_torch_thread() -> None:
    before = torch.get_num_threads()

    def job() -> int:
        torch.set_num_threads(2)  # as a thread fresh from the pool, or one a job left at 2
        return 0

    async def main() -> tuple[int, int]:
        torch_threads.install(asyncio.get_running_loop())
        await asyncio.to_thread(job)
        # the next job on that pool starts at one torch thread again
        seen = await asyncio.to_thread(torch.get_num_threads)
        return seen, torch.get_num_threads()

    try:
        next_job, on_loop = asyncio.run(main())
        assert next_job == 1 and on_loop == 1
    finally:
        torch.set_num_threads(before)


def test_compute_thread_keeps_the_count_it_is_given() -> None:
    compute = torch_threads.ComputeThread("t")

    async def main() -> int:
        await compute.run(torch.set_num_threads, 2)
        return await compute.run(torch.get_num_threads)

    try:
        assert asyncio.run(main()) == 2
    finally:
        compute.close()
