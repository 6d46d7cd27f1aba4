"""Kill -9 part of a running `tidal up --engine sim` under mixed load, and record what survived.

Used by `tidal bench faults` (the recovery figures) and `tests/fault/` (the assertions). The load
is an offline batch through the Batch API plus concurrent online streams (the official openai
client, `stream=True`); the kill comes once the batch has lines done and every stream has started.
From the kill on, a prober sends a one-token request until one succeeds (the recovery time), each
stream's tokens are timed (when it resumes, or when its client saw an error), and the batch is
waited out and its output checked for every `custom_id` exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from services.cli import natsd
from tidal_bench.stream_timing import StreamTimes, read_stream

MODEL = "tidal-sim"
REPO = Path(__file__).resolve().parents[2]
_DONE = ("completed", "failed", "expired", "cancelled")


class Stack:
    """`tidal up --engine sim` on a free port, in a temporary directory of its own; `tidal up`
    restarts each child killed. Runs this checkout's code (`python -m`, from the repository)."""

    def __init__(
        self,
        *extra: str,
        step_model: str = "linear:0.004,0.002,0,0",
        api_key: str = "unused",
        heartbeat_s: float = 0.2,  # tests: a dead instance is noticed after 0.8 s, not 2
    ) -> None:
        self.port = natsd.free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="tidal-fault-"))
        self.env = {**os.environ, "TIDAL_STATE_FILE": str(self.tmp / "up.json"),
                    "TIDAL_HEARTBEAT_S": str(heartbeat_s)}  # fmt: skip
        self.env.pop("TIDAL_NATS_URL", None)
        argv = [sys.executable, "-m", "services.cli.main", "up", "--engine", "sim", "--port",
                str(self.port), "--cpu-attn", "0", "--sim-step-model", step_model,
                "--store-dir", str(self.tmp / "js"), "--sync-always", "--log-level", "WARNING",
                *extra]  # fmt: skip
        self.log_file = (self.tmp / "up.log").open("w")
        self.proc = subprocess.Popen(argv, env=self.env, cwd=REPO, stdout=self.log_file,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.api_key = api_key
        self.extra: list[subprocess.Popen] = []  # gateways started beside `tidal up`'s
        self.client = openai.OpenAI(base_url=self.base, api_key=api_key, max_retries=0)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(openai.APIError):
                if [m.id for m in self.client.models.list()] == [MODEL]:
                    return
            assert self.proc.poll() is None, self.log_text()
            time.sleep(0.2)
        raise AssertionError(f"stack not up in {timeout_s:.0f} s:\n" + self.log_text())

    def log_text(self) -> str:
        return (self.tmp / "up.log").read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        """`tidal ctl status --json` of this stack."""
        out = subprocess.run([sys.executable, "-m", "services.cli.main", "ctl", "status",
                              "--json"], env=self.env, cwd=REPO, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        status: dict[str, Any] = json.loads(out.stdout)
        return status

    def pid_of(self, service_id: str) -> int:
        if service_id == "nats-server":
            return self.nats_pid()
        if service_id.startswith("nats-"):  # a node of `tidal up --nats-cluster`
            return self.nats_pid(service_id)
        services = self.status()["services"]
        for s in services:
            if s["id"] == service_id:
                return int(s["pid"])
        raise AssertionError(f"{service_id} not in status: {services}")

    def nats_pid(self, node: str = "") -> int:
        """The nats-server's pid; with `--nats-cluster`, that of `node` (nats-1, nats-2, ...)."""
        where = self.tmp / "js" / node if node else self.tmp / "js"
        out = subprocess.run(["pgrep", "-f", f"nats-server.*{where}( |$)"],
                             capture_output=True, text=True)  # fmt: skip
        return int(out.stdout.split()[0])

    def add_gateway(self, gateway_id: str = "gateway-1", timeout_s: float = 90.0) -> str:
        """A second gateway on the same bus (not supervised by `tidal up`); its API base URL."""
        deadline = time.monotonic() + timeout_s
        while not (self.tmp / "up.json").exists():  # `tidal up` writes it once ready
            assert time.monotonic() < deadline, self.log_text()
            time.sleep(0.1)
        url = json.loads((self.tmp / "up.json").read_text())["nats_url"]
        port = natsd.free_port()
        env = {**self.env, "TIDAL_NATS_URL": url, "TIDAL_LOG_LEVEL": "WARNING"}
        argv = [sys.executable, "-m", "services.gateway", "--id", gateway_id, "--port", str(port)]
        self.extra.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=self.log_file,
                                           stderr=subprocess.STDOUT))  # fmt: skip
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key=self.api_key, max_retries=0)
        while time.monotonic() < deadline:
            with contextlib.suppress(openai.APIError):
                if [m.id for m in client.models.list()] == [MODEL]:
                    return base
            assert self.extra[-1].poll() is None, self.log_text()
            time.sleep(0.2)
        raise AssertionError(f"{gateway_id} not up in {timeout_s:.0f} s:\n" + self.log_text())

    def stop(self) -> None:
        for p in self.extra:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log_file.close()


@dataclass
class StreamResult:
    gateway: int = 0  # which gateway it went through (0: `tidal up`'s gateway-0)
    in_flight_at_kill: bool = False  # started and not finished when the kill came
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic, one per content chunk
    error: str = ""  # the exception's type and message, if the client saw one
    timed_out: bool = False  # the error was the client's own timeout: a hang
    error_at: float | None = None


@dataclass
class Outcome:
    kill: str
    pid: int
    streams: list[StreamResult]
    recovery_s: float | None  # kill -> the first request after it that succeeded
    resume_s: float | None  # kill -> the last in-flight stream's first token after it
    error_s: float | None  # kill -> the last client error (a killed gateway's own clients)
    batch_status: str
    batch_lines: int
    batch_done_at_kill: int
    batch_lost: list[str]  # custom_ids missing from the output
    batch_duplicated: list[str]  # custom_ids in the output more than once
    batch_errors: list[str]  # first lines of the error file, if any

    def own_client(self, s: StreamResult) -> bool:
        """Was `s` a client of the gateway killed (`tidal up`'s gateway-0 is gateway 0)?"""
        return self.kill == "gateway-0" and s.gateway == 0

    def summary(self) -> dict[str, Any]:
        return {
            "kill": self.kill,
            "recovery_s": self.recovery_s,
            "resume_s": self.resume_s,
            "error_s": self.error_s,
            "streams": len(self.streams),
            "streams_in_flight_at_kill": sum(s.in_flight_at_kill for s in self.streams),
            "streams_complete": sum(1 for s in self.streams if not s.error),
            "streams_errored": sum(1 for s in self.streams if s.error),
            # errors other than a killed gateway's own clients': online requests lost
            "streams_lost": sum(1 for s in self.streams if s.error and not self.own_client(s)),
            "streams_hung": sum(1 for s in self.streams if s.timed_out),
            "batch_status": self.batch_status,
            "batch_lines": self.batch_lines,
            "batch_done_at_kill": self.batch_done_at_kill,
            "batch_lost": len(self.batch_lost),
            "batch_duplicated": len(self.batch_duplicated),
        }


async def _retrying(fn: Any, timeout_s: float) -> Any:
    """`await fn()` until it stops failing for want of a gateway (one may be restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await fn()
        except (openai.APIConnectionError, openai.InternalServerError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def stream(c: openai.AsyncOpenAI, i: int, max_tokens: int, r: StreamResult) -> None:
    """One chat stream (`ignore_eos`, usage included) read to its end into `r`."""
    got = StreamTimes(times=r.token_times)  # what came before a failure is kept
    try:
        chunks = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        await read_stream(chunks, got, time.monotonic)
        r.text = got.text
    except Exception as exc:  # what the client saw is the outcome recorded
        r.error_at = time.monotonic()
        r.error = f"{type(exc).__name__}: {exc}"
        r.timed_out = isinstance(exc, openai.APITimeoutError | httpx.TimeoutException)
    if got.finish_reason is not None:
        r.finish = got.finish_reason
    if got.num_tokens is not None:
        r.completion_tokens = got.num_tokens


async def _probe(c: openai.AsyncOpenAI, since: float, timeout_s: float) -> float | None:
    """Seconds from `since` to the first one-token request that succeeds."""
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        try:
            await c.completions.create(model=MODEL, prompt="probe", max_tokens=1, timeout=30)
            return time.monotonic() - since
        except openai.APIError:
            await asyncio.sleep(0.05)
    return None


async def _batch(c: openai.AsyncOpenAI, lines: int, max_tokens: int) -> str:
    rows = [
        {"custom_id": f"f{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": max_tokens,
                  "ignore_eos": True}}
        for i in range(lines)
    ]  # fmt: skip
    data = "\n".join(map(json.dumps, rows)).encode()
    f = await c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                               completion_window="24h")  # fmt: skip
    return b.id


async def _lines_done(c: openai.AsyncOpenAI, batch_id: str) -> tuple[str, int]:
    b = await c.batches.retrieve(batch_id)
    return b.status, b.request_counts.completed if b.request_counts else 0


async def run_mixed(
    stack: Stack,
    kill: str,
    *,
    streams: int = 32,
    max_tokens: int = 64,
    batch_lines: int = 200,
    batch_max_tokens: int = 32,
    timeout_s: float = 240.0,
) -> Outcome:
    """Start the batch, then the streams, alternately through `tidal up`'s gateway-0 and a
    second gateway; kill -9 `kill` (a service id or `nats-server`) once every stream has its
    first tokens; wait everything out."""
    pid = await asyncio.to_thread(stack.pid_of, kill)
    second = await asyncio.to_thread(stack.add_gateway)
    # a hang shows as the client's own timeout, well before the caller's deadline
    c = openai.AsyncOpenAI(base_url=stack.base, api_key=stack.api_key, max_retries=0, timeout=90)
    c2 = openai.AsyncOpenAI(base_url=second, api_key=stack.api_key, max_retries=0, timeout=90)
    try:
        batch_id = await _batch(c, batch_lines, batch_max_tokens)
        deadline = time.monotonic() + timeout_s
        while (await _lines_done(c, batch_id))[1] < 1:
            assert time.monotonic() < deadline, f"batch {batch_id}: no line done"
            await asyncio.sleep(0.1)
        results = [StreamResult(gateway=i % 2) for i in range(streams)]
        tasks = [
            asyncio.create_task(stream((c, c2)[r.gateway], i, max_tokens, r))
            for i, r in enumerate(results)
        ]
        while not all(len(r.token_times) >= 3 or r.error for r in results):
            assert time.monotonic() < deadline, "streams did not start"
            await asyncio.sleep(0.05)
        status, done_at_kill = await _lines_done(c, batch_id)
        for r, t in zip(results, tasks, strict=True):
            r.in_flight_at_kill = not t.done()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        probe = asyncio.create_task(_probe(c, killed_at, timeout_s))
        await asyncio.gather(*tasks)
        recovery_s = await probe
        while status not in _DONE:
            assert time.monotonic() < deadline + timeout_s, f"batch {batch_id} stuck: {status}"
            await asyncio.sleep(0.3)
            status, _ = await _retrying(lambda: _lines_done(c, batch_id), timeout_s)
        b = await _retrying(lambda: c.batches.retrieve(batch_id), timeout_s)
        ids: list[str] = []
        if b.output_file_id:
            out = await _retrying(lambda: c.files.content(b.output_file_id), timeout_s)
            ids = [json.loads(x)["custom_id"] for x in out.text.splitlines()]
        errors: list[str] = []
        if b.error_file_id:
            err = await _retrying(lambda: c.files.content(b.error_file_id), timeout_s)
            errors = err.text.splitlines()[:3]
    finally:
        await c.close()
        await c2.close()
    resumed = [
        min(t for t in r.token_times if t > killed_at) - killed_at
        for r in results
        if not r.error and r.token_times and r.token_times[-1] > killed_at
    ]
    errored = [r.error_at - killed_at for r in results if r.error_at is not None]
    counts = Counter(ids)
    return Outcome(
        kill=kill,
        pid=pid,
        streams=results,
        recovery_s=recovery_s,
        resume_s=max(resumed) if resumed else None,
        error_s=max(errored) if errored else None,
        batch_status=b.status,
        batch_lines=batch_lines,
        batch_done_at_kill=done_at_kill,
        batch_lost=[f"f{i}" for i in range(batch_lines) if f"f{i}" not in counts],
        batch_duplicated=sorted(k for k, n in counts.items() if n > 1),
        batch_errors=errors,
    )
