"""`tidal bench idle`'s measurement: a process's share of a core over a window (a busy loop
shows near 100 %, a sleeping one near 0), and the processes of a stack found below its
`tidal up` (`tidal_bench.kit.up_pid`, `children_of`)."""

from __future__ import annotations

import subprocess
import sys
import time

from tidal_bench.kit import children_of, up_pid
from tidal_bench.serve.idle import cpu_shares


def test_a_busy_process_shows_near_a_whole_core_and_a_sleeping_one_near_none() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        shares = cpu_shares({"sleeper": sleeper.pid, "busy": busy.pid}, 1.0)
    finally:
        busy.kill()
        sleeper.kill()
    assert shares["busy"] > 50.0 and shares["sleeper"] < 5.0
    assert list(shares) == ["busy", "sleeper"]  # most first


def test_a_stacks_processes_are_the_children_of_its_tidal_up_named_by_their_id() -> None:
    # a stand-in `tidal up --port 65001` whose child is a service with an --id
    service = "[sys.executable, '-c', 'import time; time.sleep(30)', '--id', 'svc-0']"
    child = f"import subprocess, sys, time; subprocess.Popen({service}); time.sleep(30)"
    root = subprocess.Popen([sys.executable, "-c", child, "up", "--port", "65001"])
    found: dict[str, int] = {}
    try:
        assert up_pid(65001) == root.pid
        for _ in range(50):
            found = children_of(root.pid)
            if "svc-0" in found:
                break
            time.sleep(0.1)
        assert list(found) == ["svc-0"]
    finally:
        for pid in found.values():
            subprocess.run(["kill", "-9", str(pid)], check=False)
        root.kill()
