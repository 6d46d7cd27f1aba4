"""CPU-attention workers on the live stack: `tidal up` with the omniserve policy, a KV pool too
small for the offline load, and one worker; offline decodes that do not fit are offloaded to the
worker and finish there, the worker shows in `tidal ctl status` and `/metrics`, and a worker
killed (-9) mid-decode loses nothing: its requests recompute on the instance."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.cli import natsd

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.slow]

WORDS = "The history of the tide mills of the Atlantic coast, told from the mill records. " * 10
NUM_TOKENS = 24


class Stack:
    def __init__(self) -> None:
        self.port = natsd.free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="tidal-e2e-cpu-attn-"))
        self.env = {**os.environ, "TIDAL_STATE_FILE": str(self.tmp / "up.json")}
        self.base = f"http://127.0.0.1:{self.port}"

    @contextlib.contextmanager
    def up(self) -> Iterator[Stack]:
        argv = [sys.executable, "-m", "services.cli.main", "up", "--port", str(self.port)]
        argv += ["--engine", "torch", "--policy", "omniserve", "--instances", "aggregated"]
        argv += ["--kv-cache-tokens", "1024", "--cpu-attn", "1"]
        argv += ["--store-dir", str(self.tmp / "js")]
        with (self.tmp / "up.log").open("w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
            try:
                yield self
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)

    def log(self) -> str:
        return (self.tmp / "up.log").read_text(errors="replace")[-4000:]

    def status(self) -> dict:  # type: ignore[type-arg]
        cmd = [sys.executable, "-m", "services.cli.main", "ctl", "status", "--json"]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def worker(self) -> dict | None:  # type: ignore[type-arg]
        services = self.status().get("services", [])
        return next((s for s in services if s["kind"] == "cpu_attn" and s["info"]), None)

    def metrics(self) -> str:
        return urllib.request.urlopen(self.base + "/metrics", timeout=10).read().decode()

    async def offline_load(
        self, on_offloaded: object = None, num_tokens: int = NUM_TOKENS
    ) -> list[str]:
        """8 offline prompts of ~200 tokens at once (about four fit the 1024-token pool),
        streamed; returns each one's text. `on_offloaded` runs once offloads have happened."""
        client = openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 240
        models: list[str] = []
        while not models or self.worker() is None:  # the model is served, the worker joined
            assert time.monotonic() < deadline, self.log()
            with contextlib.suppress(openai.APIError):
                models = [m.id async for m in client.models.list()]
            await asyncio.sleep(0.5)

        async def one(i: int) -> str:
            stream = await client.completions.create(
                model=models[0],
                prompt=f"{i}: {WORDS}",
                max_tokens=num_tokens,
                temperature=0,
                stream=True,
                timeout=600,
                extra_body={"request_class": "offline", "ignore_eos": True},
                stream_options={"include_usage": True},
            )
            text, n = "", 0
            async for c in stream:
                if c.choices:
                    text += c.choices[0].text
                if c.usage is not None:
                    n = c.usage.completion_tokens
            assert n == num_tokens, (i, n, text)
            return text

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        if on_offloaded is not None:
            while _metric(self.metrics(), "tidal_cpu_attn_offloaded_requests") < 1:
                assert time.monotonic() < deadline + 300, self.log()
                assert not all(t.done() for t in tasks), "finished with nothing offloaded"
                await asyncio.sleep(0.2)
            await asyncio.to_thread(on_offloaded)  # type: ignore[arg-type]
        return await asyncio.gather(*tasks)


def _metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_offline_decodes_past_the_kv_pool_run_on_a_cpu_attention_worker() -> None:
    with Stack().up() as st:
        texts = asyncio.run(st.offline_load())
        assert all(texts)
        metrics = st.metrics()
        assert _metric(metrics, "tidal_offloads_total") >= 1, st.log()
        assert "tidal_cpu_attn_layer_seconds_bucket" in metrics
        assert _metric(metrics, "tidal_cpu_attn_layer_seconds_count") > 0
        worker = st.worker()
        assert worker is not None and int(worker["info"]["offloads_total"]) >= 1
        assert "Traceback" not in st.log()


@pytest.mark.fault
def test_a_cpu_attention_worker_killed_mid_decode_loses_no_request() -> None:
    """Longer outputs than the other test's, and the worker's pid known before the load: an
    offloaded request must still be on the worker when the kill lands (with 24 tokens, one
    could finish or be recalled while `ctl status` looked the pid up, and then nothing was
    lost)."""
    with Stack().up() as st:
        killed: list[int] = []
        pid: list[int] = []

        def kill() -> None:
            os.kill(pid[0], signal.SIGKILL)
            killed.append(pid[0])

        async def load() -> list[str]:
            deadline = time.monotonic() + 240
            while (worker := st.worker()) is None:
                assert time.monotonic() < deadline, st.log()
                await asyncio.sleep(0.5)
            pid.append(worker["pid"])
            return await st.offline_load(on_offloaded=kill, num_tokens=4 * NUM_TOKENS)

        texts = asyncio.run(load())
        # every stream got all its tokens once (checked in offline_load), after a recompute
        assert killed and all(texts)
        assert "lost its CPU-attention worker; recomputing" in (st.tmp / "up.log").read_text()
