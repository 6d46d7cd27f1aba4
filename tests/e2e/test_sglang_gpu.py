"""Tidal on a real SGLang: openai client -> gateway -> `--engine sglang` instances -> SGLang.

Needs a CUDA GPU and SGLang installed (never run in CI; `pytest -m gpu tests/e2e/
test_sglang_gpu.py`): `TIDAL_SGLANG_MODEL` is a Hugging Face model directory and
`TIDAL_SGLANG_PYTHON` the Python that has `sglang` (default: this one). Two SGLang servers share
the GPU, one per instance (relaxed + strict, policy `tidal`); the PD case runs a prefill/decode
pair under one instance (`TIDAL_SGLANG_PD_TRANSFER`, default mooncake_tcp).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from services.cli import natsd
from services.instance.sglang.launcher import SglangProcess, free_port
from tidal.engine.tokenizer import load_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.nats, pytest.mark.slow]

# batch-invariant kernels: a greedy request gives the same tokens whatever runs beside it, so a
# recompute can be compared token for token
SERVER_ARGS = ["--mem-fraction-static", "0.35", "--max-running-requests", "8"]
SERVER_ARGS += ["--enable-deterministic-inference"]


@dataclass
class SglangStack:
    base: str  # the gateway, http://127.0.0.1:PORT
    sglang_urls: list[str]
    model: str  # the path, also the served model name
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0)


def _model_and_python() -> tuple[str, str]:
    model = os.environ.get("TIDAL_SGLANG_MODEL", "")
    if not model or not Path(model, "config.json").exists():
        pytest.fail("set TIDAL_SGLANG_MODEL to a Hugging Face model directory (config.json)")
    python = os.environ.get("TIDAL_SGLANG_PYTHON", sys.executable)
    found = subprocess.run([python, "-c", "import sglang"], capture_output=True, timeout=120)
    if found.returncode != 0:
        pytest.fail(f"{python} cannot import sglang; set TIDAL_SGLANG_PYTHON")
    return model, python


@pytest.fixture(scope="module")
def stack() -> Iterator[SglangStack]:
    model, python = _model_and_python()
    servers = [SglangProcess(python, model, "127.0.0.1", free_port(), SERVER_ARGS) for _ in "rs"]
    tmp = Path(tempfile.mkdtemp(prefix="tidal-e2e-sglang-"))
    proc = None
    try:
        for s in servers:
            s.wait_ready(900)
        port = natsd.free_port()
        env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json")}
        env.pop("TIDAL_NATS_URL", None)
        tidal = str(Path(sys.executable).parent / "tidal")
        argv = [tidal, "up", "--engine", "sglang", "--model", model, "--port", str(port)]
        argv += ["--sglang-urls", ",".join(s.url for s in servers), "--cpu-attn", "0"]
        argv += ["--store-dir", str(tmp / "js"), "--log-level", "INFO"]
        with open(tmp / "up.log", "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        st = SglangStack(
            f"http://127.0.0.1:{port}", [s.url for s in servers], model, tmp / "up.log"
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if [m.id for m in st.client().models.list()]:
                    break
            except openai.APIError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("the stack did not list a model:\n" + st.log.read_text())
        yield st
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        for s in servers:
            s.stop()


def sglang_alone(url: str, input_ids: list[int], max_new: int) -> list[int]:
    """Greedy tokens from SGLang's own /generate, no Tidal in between."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return [int(t) for t in json.loads(r.read())["output_ids"]]


def metric(base: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


def test_the_openai_client_streams_from_real_sglang(stack: SglangStack) -> None:
    chunks = list(
        stack.client().chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].system_fingerprint == "tidal-sglang"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_recompute_migration_keeps_the_output(stack: SglangStack) -> None:
    """The `tidal` policy pushes an online request from the relaxed to the strict instance; on
    SGLang that is abort + resubmit with the generated ids, and greedy output is unchanged."""
    before = metric(stack.base, "tidal_migrations_total", outcome="ok", mode="recompute")
    prompt = "Write a long story about a lighthouse keeper."
    got = stack.client().completions.create(
        model=stack.model,
        prompt=prompt,
        max_tokens=96,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.usage is not None and got.usage.completion_tokens == 96
    tok = load_tokenizer(stack.model)
    alone = sglang_alone(stack.sglang_urls[0], tok.encode(prompt), 96)
    assert got.choices[0].text == tok.decode(alone)
    deadline = time.monotonic() + 30
    while metric(stack.base, "tidal_migrations_total", outcome="ok", mode="recompute") <= before:
        assert time.monotonic() < deadline, "no recompute migration was counted"
        time.sleep(0.2)


def test_online_work_overtakes_offline_work_by_sglang_priority(stack: SglangStack) -> None:
    """Offline requests fill SGLang's running slots (8); an online request arriving behind them
    goes in at a higher SGLang priority and ends long before the offline ones, which all end
    with every token they asked for (preempted ones recompute, nothing is lost)."""
    client = stack.client()

    def ask(cls: str, n: int) -> tuple[str, float, int]:
        r = client.completions.create(
            model=stack.model,
            prompt="Count slowly from one to one thousand.",
            max_tokens=n,
            temperature=0,
            extra_body={"request_class": cls, "ignore_eos": True},
        )
        assert r.usage is not None
        return cls, time.monotonic(), r.usage.completion_tokens

    with cf.ThreadPoolExecutor(40) as pool:
        offline = [pool.submit(ask, "offline", 1024) for _ in range(32)]
        time.sleep(3)
        online = pool.submit(ask, "online", 16)
        _, online_done, online_n = online.result(timeout=600)
        still_running = sum(1 for f in offline if not f.done())
        results = [f.result(timeout=1800) for f in offline]
    assert online_n == 16
    assert still_running >= 16, "the online request waited behind the offline work"
    assert all(n == 1024 for _, _, n in results)
    assert all(done > online_done for _, done, _ in results[-16:])


# ---- a prefill/decode pair under one instance (SGLang PD disaggregation) ----

PD_TRANSFER = os.environ.get("TIDAL_SGLANG_PD_TRANSFER", "mooncake_tcp")  # no RDMA needed


@pytest.fixture(scope="module")
def pd_stack() -> Iterator[SglangStack]:
    """One `aggregated` instance over a prefill and a decode server sharing the GPU (KV moved
    by `TIDAL_SGLANG_PD_TRANSFER`, default mooncake_tcp)."""
    model, python = _model_and_python()
    common = ["--mem-fraction-static", "0.3", "--disaggregation-transfer-backend", PD_TRANSFER]
    boot = free_port()
    prefill = SglangProcess(
        python,
        model,
        "127.0.0.1",
        free_port(),
        [*common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)],
    )
    decode = SglangProcess(
        python, model, "127.0.0.1", free_port(), [*common, "--disaggregation-mode", "decode"]
    )
    tmp = Path(tempfile.mkdtemp(prefix="tidal-e2e-sglang-pd-"))
    proc = None
    try:
        prefill.wait_ready(900)
        decode.wait_ready(900)
        port = natsd.free_port()
        env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json")}
        env.pop("TIDAL_NATS_URL", None)
        tidal = str(Path(sys.executable).parent / "tidal")
        argv = [tidal, "up", "--engine", "sglang", "--model", model, "--port", str(port)]
        argv += ["--policy", "aggregated", "--instances", "aggregated", "--cpu-attn", "0"]
        argv += ["--sglang-urls", prefill.url, "--sglang-decode-urls", decode.url]
        argv += ["--store-dir", str(tmp / "js"), "--log-level", "INFO"]
        with open(tmp / "up.log", "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        st = SglangStack(
            f"http://127.0.0.1:{port}", [prefill.url, decode.url], model, tmp / "up.log"
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if [m.id for m in st.client().models.list()]:
                    break
            except openai.APIError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("the PD stack did not list a model:\n" + st.log.read_text())
        yield st
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        decode.stop()
        prefill.stop()


def test_a_pd_pair_serves_the_openai_client_and_counts_its_kv_pushes(
    pd_stack: SglangStack,
) -> None:
    before = metric(pd_stack.base, "tidal_migrations_total", mode="pd_transfer", outcome="ok")
    got = pd_stack.client().completions.create(
        model=pd_stack.model,
        prompt="The capital of France is",
        max_tokens=48,
        temperature=0,
        extra_body={"request_class": "online", "ignore_eos": True},
    )
    assert got.usage is not None and got.usage.completion_tokens == 48
    assert "Paris" in got.choices[0].text
    deadline = time.monotonic() + 30  # heartbeats carry the count to the gateway
    while (
        metric(pd_stack.base, "tidal_migrations_total", mode="pd_transfer", outcome="ok") <= before
    ):
        assert time.monotonic() < deadline, "no prefill -> decode push was counted"
        time.sleep(0.2)
