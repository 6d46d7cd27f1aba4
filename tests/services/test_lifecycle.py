"""Every service exits with a one-line reason when the bus is unreachable, and drains on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.cli import natsd

SERVICES = ("services.scheduler", "services.instance", "services.cpu_attn", "services.gateway")


@pytest.mark.parametrize("module", SERVICES)
def test_unreachable_bus_gives_one_line_and_exit_1(module: str) -> None:
    url = f"nats://127.0.0.1:{natsd.free_port()}"
    argv = [sys.executable, "-m", module, "--nats-url", url, "--connect-timeout-s", "1"]
    if module == "services.gateway":
        argv += ["--port", str(natsd.free_port())]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        env={"TIDAL_LOG_LEVEL": "CRITICAL", "PATH": ""},
    )
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot reach NATS" in lines[0], out.stderr


def test_bad_configuration_is_a_clear_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.instance", "--id", "bad.id"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "instance id 'bad.id'" in out.stderr


@pytest.mark.nats
def test_services_drain_and_exit_0_on_sigterm(nats_url: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", m, "--nats-url", nats_url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TIDAL_LOG_LEVEL": "INFO"},
        )
        for m in ("services.scheduler", "services.cpu_attn", "services.instance")
    ]
    logs: list[list[str]] = [[] for _ in procs]
    readers = [
        threading.Thread(target=lambda p=p, out=out: out.extend(p.stderr), daemon=True)
        for p, out in zip(procs, logs, strict=True)
    ]
    for t in readers:
        t.start()
    # NOTE: wait for each to say it is ready (connected, handlers installed), not a fixed time:
    # on a loaded machine importing torch alone can take longer than any sleep chosen here
    deadline = time.monotonic() + 120
    while not all(any(" ready" in line for line in out) for out in logs):
        assert time.monotonic() < deadline, logs
        assert all(p.poll() is None for p in procs), logs
        time.sleep(0.1)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p, out in zip(procs, logs, strict=True):
        assert p.wait(timeout=30) == 0, "".join(out)
