"""One lifecycle for every service: logging, a stop event set by SIGINT/SIGTERM, drain on exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from services.common.bus import BusUnavailable
from tidal import envs


def setup_logging(service: str) -> None:
    logging.basicConfig(
        level=envs.LOG_LEVEL.get().upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)


async def wait_either(a: asyncio.Event, b: asyncio.Event, timeout_s: float) -> None:
    """Wait until `a` or `b` is set, or `timeout_s` has passed: a service's idle wait for work
    or its stop (a stop is never kept waiting for the timeout)."""
    waits = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


def run_service(name: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `main(stop)` until it returns; exit 1 with a one-line reason if NATS is unreachable."""
    setup_logging(name)

    async def _run() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        await main(stop)

    try:
        asyncio.run(_run())
    except BusUnavailable as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # configuration errors carry a message a user can act on
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    return 0
