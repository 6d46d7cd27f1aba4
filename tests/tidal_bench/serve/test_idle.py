"""`tidal bench idle`'s measurement: a process's share of a core read from /proc over a window
(a busy loop shows near 100 %, a sleeping one near 0), and the processes of a stack found by
their ancestry."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tidal_bench.serve.idle import cpu_shares, stack_processes


def test_a_busy_process_shows_near_a_whole_core_and_a_sleeping_one_near_none() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        shares = cpu_shares({busy.pid: "busy", sleeper.pid: "sleeper"}, 1.0)
    finally:
        busy.kill()
        sleeper.kill()
    assert shares["busy"] > 50.0 and shares["sleeper"] < 5.0
    assert list(shares) == ["busy", "sleeper"]  # most first


def test_a_stacks_processes_are_its_descendants_named_by_their_id() -> None:
    # a stand-in `tidal up --port 65001` whose child is a service with an --id
    service = "[sys.executable, '-c', 'import time; time.sleep(30)', '--id', 'svc-0']"
    child = f"import subprocess, sys, time; subprocess.Popen({service}); time.sleep(30)"
    root = subprocess.Popen([sys.executable, "-c", child, "up", "--port", "65001"])
    try:
        found: dict[int, str] = {}
        for _ in range(50):
            found = stack_processes(65001)
            if "svc-0" in found.values():
                break
            time.sleep(0.1)
        assert found.get(root.pid) == "tidal up" and "svc-0" in found.values()
        assert os.getpid() not in found
    finally:
        for pid in found:
            if pid != root.pid:
                os.kill(pid, 9)
        root.kill()
