"""The child processes of `tidal up`: each started in its own session, pinned to its cores from
its first instruction and sent SIGTERM if `tidal up` itself dies; restarted with exponential
back-off when it dies unexpectedly (reset once it stayed up a while); stopped with a grace
period, then killed. Also the HTTP probe `tidal up` waits for health with.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a child up this long has its back-off reset
STOP_GRACE_S = 10.0


def _die_with_parent() -> None:
    """Children get SIGTERM if `tidal up` itself is killed (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    started_s: float = 0.0
    backoff_s: float = BACKOFF_START_S
    num_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    cores: tuple[int, ...] = ()  # pinned here from its first instruction (): unpinned

    async def start(self) -> None:
        cores = self.cores

        def setup() -> None:
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=setup,
            stdin=asyncio.subprocess.DEVNULL,
        )
        self.started_s = time.monotonic()


def say(msg: str) -> None:
    print(f"tidal up: {msg}", file=sys.stderr, flush=True)


async def watch(child: Child, stopping: asyncio.Event) -> None:
    """Restart `child` whenever it dies, with exponential back-off, until `stopping` is set."""
    while True:
        assert child.proc is not None
        code = await child.proc.wait()
        if stopping.is_set():
            return
        ran_s = time.monotonic() - child.started_s
        if ran_s > STABLE_AFTER_S:
            child.backoff_s = BACKOFF_START_S
        say(
            f"{child.name} (pid {child.proc.pid}) {describe_exit(code)} after {ran_s:.1f}s; "
            f"restarting in {child.backoff_s:.1f}s"
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=child.backoff_s)
        if stopping.is_set():
            return
        child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
        child.num_restarts += 1
        await child.start()
        say(f"{child.name} restarted (pid {child.proc.pid}, restart #{child.num_restarts})")


async def terminate(children: list[Child]) -> None:
    """SIGTERM to every child still running; those not gone in `STOP_GRACE_S` are killed."""
    procs = [c.proc for c in children if c.proc is not None and c.proc.returncode is None]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), STOP_GRACE_S)
    except TimeoutError:
        for c in children:
            if c.proc is not None and c.proc.returncode is None:
                say(f"{c.name} did not stop in {STOP_GRACE_S:.0f}s; killing it")
                c.proc.kill()
        await asyncio.gather(*(p.wait() for p in procs))


def http_ok(url: str, require_data: bool = False, api_key: str = "") -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=1
        ) as resp:
            body = resp.read()
            return resp.status == 200 and (not require_data or b'"id"' in body)
    except (OSError, ValueError):
        return False
