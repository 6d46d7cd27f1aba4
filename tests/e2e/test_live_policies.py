"""The live co-location loop as a user starts it: `tidal up --engine sim --policy NAME` with the
scheduler and every instance running the policy, driven by the official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from services.cli import natsd
from tests.e2e.metrics_kit import metric
from tidal.policy.registry import available_policies

pytestmark = [pytest.mark.e2e, pytest.mark.nats]
MODEL = "tidal-sim"


@contextmanager
def up(policy: str, step_model: str) -> Iterator[str]:
    """`tidal up` on a free port; yields the gateway's base URL once it serves the model."""
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-live-"))
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json"), "TIDAL_HEARTBEAT_S": "0.2"}
    env.pop("TIDAL_NATS_URL", None)
    tidal = str(Path(sys.executable).parent / "tidal")
    argv = [tidal, "up", "--engine", "sim", "--port", str(port), "--policy", policy]
    argv += ["--sim-step-model", step_model, "--cpu-attn", "0", "--log-level", "WARNING"]
    argv += ["--store-dir", str(tmp / "jetstream")]
    log = (tmp / "up.log").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=1) as r:
                    if MODEL.encode() in r.read():
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp / "up.log").read_text()
            time.sleep(0.2)
        else:
            raise AssertionError("stack not up in 60 s:\n" + (tmp / "up.log").read_text())
        time.sleep(0.5)  # the scheduler has every instance's first state report
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def ask(base: str, prompt: str, max_tokens: int, cls: str) -> openai.types.Completion:
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    return c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"request_class": cls}
    )


@pytest.mark.slow
@pytest.mark.parametrize("policy", available_policies())
def test_every_registered_policy_starts_and_serves(policy: str) -> None:
    with up(policy, "linear:0.002,0,0,0") as base, cf.ThreadPoolExecutor(4) as pool:
        jobs = [
            pool.submit(ask, base, f"tell me about the tide, number {i}", 5, cls)
            for i, cls in enumerate(["online", "offline", "online", "offline"])
        ]
        for job in jobs:
            resp = job.result(timeout=90)
            assert resp.choices[0].finish_reason == "length"
            assert resp.usage is not None and resp.usage.completion_tokens == 5


def test_tidal_policy_pushes_and_pulls_with_outputs_unchanged() -> None:
    with up("tidal", "linear") as base, cf.ThreadPoolExecutor(12) as pool:
        prompts = [f"Hello there, tell me a story about the sea number {i}" for i in range(6)]
        jobs = [
            pool.submit(ask, base, p, 20, cls) for cls in ("offline", "online") for p in prompts
        ]
        outs = [j.result(timeout=120) for j in jobs]
        assert all(o.choices[0].finish_reason == "length" for o in outs)
        # Online requests were pushed after prefill, offline ones pulled (or not): every text
        # equals the same prompt's text in the other class.
        assert [o.choices[0].text for o in outs[:6]] == [o.choices[0].text for o in outs[6:]]
        assert metric(base, "tidal_migrations_total", kind="push", outcome="ok") >= 1
        assert metric(base, "tidal_kv_transfer_bytes_total") > 0
        assert (
            "tidal_slo_requests_total{"
            in urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        )


def test_online_arrival_preempts_offline_prefill_and_offline_still_finishes() -> None:
    # 30 ms + 0.1 ms per token per emulated step: under OOCO's 50 ms offline step cap, the
    # relaxed instance prefills the long offline prompts in ~200-token chunks for seconds.
    doc = " ".join(f"word{i}" for i in range(700))  # ~2.7k SmolLM2 tokens
    with up("tidal", "linear:0.03,0.0001,0,0") as base, cf.ThreadPoolExecutor(12) as pool:
        offline = [
            pool.submit(ask, base, f"summarise document {i}: {doc}", 8, "offline") for i in range(6)
        ]
        time.sleep(1.0)  # mid-way through the offline prefill
        online = []
        for i in range(5):  # each arrival that lands inside an offline step cuts it
            online.append(pool.submit(ask, base, f"quick question {i} about the moon", 6, "online"))
            time.sleep(0.2)
        outs = [j.result(timeout=120) for j in online + offline]
        assert all(o.choices[0].finish_reason == "length" for o in outs)
        assert metric(base, "tidal_preemptions_total") >= 1
        # The cut chunks resumed without harm: the same prompt served alone gives the same text.
        alone = ask(base, f"summarise document 0: {doc}", 8, "online")
        assert outs[len(online)].choices[0].text == alone.choices[0].text


def test_strict_instance_pulls_offline_decodes() -> None:
    # OOCO §3.4.3: a strict instance whose step has slack pulls offline decodes from the
    # relaxed one. Its `schedule` (where it finds the slack) runs only when it has work, as in
    # the simulator: the online requests pushed to it give it some.
    with up("tidal", "linear:0.03,0.0001,0,0") as base, cf.ThreadPoolExecutor(8) as pool:
        offline = [
            pool.submit(ask, base, f"summarise document {i} about waves", 64, "offline")
            for i in range(4)
        ]
        time.sleep(0.5)
        online = [
            pool.submit(ask, base, f"quick question {i} about the moon", 48, "online")
            for i in range(2)
        ]
        outs = [j.result(timeout=120) for j in offline + online]
        assert [o.usage.completion_tokens for o in outs if o.usage] == [64] * 4 + [48] * 2
        assert metric(base, "tidal_migrations_total", kind="pull", outcome="ok") >= 1
