"""What the `tidal bench` commands share: a `tidal up` stack on a free port, percentiles, and
writing a report as JSON."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (numpy's, linear between ranks); NaN for no values. The one
    percentile every bench and the simulator's metrics use."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def metric_samples(base: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample on a gateway's /metrics (`base`: its root or API
    URL), read with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    url = base.removesuffix("/v1") + "/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def gateway_metrics(base: str) -> dict[str, float]:
    """The gateway's /metrics samples summed by name (labels dropped); `base` is the API URL."""
    out: dict[str, float] = {}
    for name, _, value in metric_samples(base):
        out[name] = out.get(name, 0.0) + value
    return out


def save_json(path: str, report: dict[str, Any]) -> None:
    """Write `report` to `path` as JSON (nothing when `path` is empty). An argparse namespace in
    it is written as its options, without the command's function."""
    if not path:
        return
    clean = {
        k: {a: v for a, v in vars(x).items() if not callable(v)}
        if isinstance(x, argparse.Namespace)
        else x
        for k, x in report.items()
    }
    Path(path).write_text(json.dumps(clean, indent=2, default=str))


@contextlib.contextmanager
def stack(
    port: int, *up_args: str, start_timeout_s: float = 240.0, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`tidal up --port PORT *up_args` (`env` added to this process's environment); yields the
    API base URL once it serves a model."""
    tmp = tempfile.mkdtemp(prefix="tidal-bench-")
    env = {**os.environ, **(env or {}), "TIDAL_STATE_FILE": f"{tmp}/up.json"}
    # `python -m`, not the `tidal` script: the stack runs the code this process imported (a
    # worktree's, from its directory), not whatever the venv's entry point resolves to
    argv = [sys.executable, "-m", "services.cli.main", "up", "--port", str(port)]
    argv += ["--log-level", "WARNING", "--store-dir", tmp, *up_args]
    log_path = Path(tmp) / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(base + "/models") as r:
                if b'"id"' in r.read():
                    break
            if proc.poll() is not None:  # `tidal up` gave up: say why, do not wait out the clock
                tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
                raise RuntimeError(
                    f"the benchmark stack exited ({proc.returncode}) before serving: "
                    + "\n".join(tail)
                )
            time.sleep(0.2)
        else:
            raise RuntimeError(
                f"the benchmark stack did not start within {start_timeout_s} s (log: {log_path})"
            )
        time.sleep(1.0)  # every instance's first state report has reached the scheduler
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


@functools.cache  # the tokenizer is read once per process
def bos_tokens() -> int:
    """Tokens the served tokenizer (the sim engine's default, SmolLM2's) adds to every prompt
    (a BOS)."""
    from tidal.engine.sim.tokens import load_sim_tokenizer

    return len(load_sim_tokenizer().encode("tide")) - 1


# words the served tokenizer reads as one token each after a space (test_kit checks)
PROMPT_WORDS = (" tide", " sea", " wave", " sand", " shell", " boat", " wind", " salt")


def distinct_prompt_maker(seed: int | None = None) -> Any:
    """prompt(n) -> a string the served tokenizer (the sim engine's default, SmolLM2's) reads as
    exactly n tokens, "tide" then words drawn at random (`seed`; None: fresh each process), plus
    whatever the tokenizer adds (a BOS). Two prompts share a first KV block (16 tokens, 14 of
    them drawn from 8 words) with odds of 8**-14, so the torch engine's prefix cache serves none
    of one prompt from another. The benches' earlier "tide tide ..." prompts were each other's
    prefixes: the cache served all but their last partial block (88 % of the prompt tokens of
    40 lines of 8-256 tokens), which neither the simulator nor the offline limit counts, so a
    live run measured far less prefill than they charge."""
    import random

    extra, rng = bos_tokens(), random.Random(seed)

    def prompt(n: int) -> str:
        return "tide" + "".join(rng.choice(PROMPT_WORDS) for _ in range(max(0, n - 1 - extra)))

    return prompt


# ---- processes of a stack, and the CPU they use (from /proc) ----


def _ticks(path: str) -> list[int]:
    with open(path) as f:
        return [int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]]  # utime, stime


class CpuClock:
    """CPU seconds over a window, from /proc: each named process's (user + system) and each
    core's busy time (everything but idle and iowait), so a figure says how much of its cores a
    service actually got on a machine shared with other work."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.hz = os.sysconf("SC_CLK_TCK")
        self.t0, self.proc0, self.core0 = time.monotonic(), self._procs(), self._cores()

    def _procs(self) -> dict[str, int]:
        out = {}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[name] = sum(_ticks(f"/proc/{pid}/stat"))
        return out

    @staticmethod
    def _cores() -> dict[int, tuple[int, int]]:
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *vals = line.split()
                if name.startswith("cpu") and name != "cpu":
                    v = [int(x) for x in vals]
                    out[int(name[3:])] = (sum(v) - v[3] - v[4], sum(v))  # busy, all
        return out

    def read(self) -> dict[str, Any]:
        """{"window_s", "cpu_s": {name: s}, "core_busy": {core: fraction}}."""
        procs, cores = self._procs(), self._cores()
        return {
            "window_s": round(time.monotonic() - self.t0, 2),
            "cpu_s": {
                n: round((procs[n] - self.proc0[n]) / self.hz, 2) for n in procs if n in self.proc0
            },
            "core_busy": {
                c: round((b - self.core0[c][0]) / max(1, a - self.core0[c][1]), 3)
                for c, (b, a) in cores.items()
                if c in self.core0
            },
        }


def children_of(parent: int) -> dict[str, int]:
    """`--id` of each direct child of `parent` (a `tidal up`) -> its pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            name = argv[argv.index("--id") + 1] if "--id" in argv else Path(argv[0]).name
            out[name] = int(entry)
    return out


def up_pid(port: int) -> int:
    """The pid of this process's child `tidal up --port PORT` (tidal_bench.kit.stack's)."""
    for pid in children_of(os.getpid()).values():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        if "up" in argv and "--port" in argv and argv[argv.index("--port") + 1] == str(port):
            return pid
    raise RuntimeError(f"no `tidal up --port {port}` below this process")
