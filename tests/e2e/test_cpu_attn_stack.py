"""CPU-attention workers on the live stack: `tidal up` with the omniserve policy, a KV pool too
small for the offline load, and one worker; offline decodes that do not fit are offloaded to the
worker and finish there, and the worker shows in `tidal ctl status` and `/metrics`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from services.cli import natsd

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.slow]

WORDS = "The history of the tide mills of the Atlantic coast, told from the mill records. " * 10


def _metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_offline_decodes_past_the_kv_pool_run_on_a_cpu_attention_worker() -> None:
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-e2e-cpu-attn-"))
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json")}
    up = [sys.executable, "-m", "services.cli.main", "up", "--port", str(port)]
    up += ["--engine", "torch", "--policy", "omniserve", "--instances", "aggregated"]
    up += ["--kv-cache-tokens", "1024", "--cpu-attn", "1", "--store-dir", str(tmp / "js")]
    log = open(tmp / "up.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(up, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    async def run() -> list[openai.types.Completion]:
        deadline = time.monotonic() + 240
        models: list[str] = []
        while not models and time.monotonic() < deadline:
            try:
                models = [m.id async for m in client.models.list()]
            except openai.APIError:
                await asyncio.sleep(0.5)
        assert models, (tmp / "up.log").read_text()[-3000:]
        while b"cpu-attn-0" not in _status(env):  # the worker has joined
            assert time.monotonic() < deadline, (tmp / "up.log").read_text()[-3000:]
            await asyncio.sleep(0.5)

        async def one(i: int) -> openai.types.Completion:
            return await client.completions.create(
                model=models[0],
                prompt=f"{i}: {WORDS}",
                max_tokens=24,
                temperature=0,
                timeout=600,
                extra_body={"request_class": "offline", "ignore_eos": True},
            )

        # 8 prompts of ~200 tokens: about four fit the 1024-token pool at once
        return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        done = asyncio.run(run())
        assert all(c.usage is not None and c.usage.completion_tokens == 24 for c in done)
        assert all(c.choices[0].text for c in done)
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        log_text = (tmp / "up.log").read_text()
        assert _metric(metrics, "tidal_offloads_total") >= 1, log_text[-3000:]
        assert "tidal_cpu_attn_layer_seconds_bucket" in metrics
        assert _metric(metrics, "tidal_cpu_attn_layer_seconds_count") > 0
        status = json.loads(_status(env, "--json"))
        worker = next(s for s in status["services"] if s["kind"] == "cpu_attn")
        assert int(worker["info"]["offloads_total"]) >= 1
        assert "Traceback" not in log_text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.close()


def _status(env: dict[str, str], *extra: str) -> bytes:
    cmd = [sys.executable, "-m", "services.cli.main", "ctl", "status", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, timeout=60).stdout
