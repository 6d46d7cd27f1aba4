"""A Tidal stack over real SGLang servers, for the `sglang`-marked end-to-end tests.

`TIDAL_SGLANG_PYTHON`: the Python that has `sglang` (default: this one; `make test-sglang`
builds a CPU one, scripts/sglang_cpu_env.sh). `TIDAL_SGLANG_MODEL`: a Hugging Face model
directory, or `embedded` (the default) for the embedded SmolLM2 exported as one.
`TIDAL_SGLANG_ARGS`: extra `launch_server` arguments for every server; the default,
`--enable-deterministic-inference`, makes a greedy request's tokens independent of what runs
beside it, so a recompute can be compared token for token. SGLang allows that only with GPU
attention backends; `make test-sglang` passes `--device cpu --attention-backend torch_native
--dtype float32 ...` instead: in fp32 a batch's rounding does not flip a near-tie between two
tokens, as bf16's does (docs/models.md, the torch engine's dtype note).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
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
from services.instance.sglang.launcher import SglangProcess
from tidal.engine.tokenizer import embedded_model_path
from tidal.engine.torch.weights import gguf_to_hf_dir


@dataclass
class SglangStack:
    base: str  # the gateway, http://127.0.0.1:PORT
    sglang_urls: list[str]
    model: str  # the path, also the served model name
    log: Path

    def client(self) -> openai.OpenAI:
        # SGLang's torch-native CPU path decodes a few tokens/s a request under load
        return openai.OpenAI(
            base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=1800
        )


def extra_server_args() -> list[str]:
    return shlex.split(os.environ.get("TIDAL_SGLANG_ARGS", "--enable-deterministic-inference"))


def embedded_hf_dir() -> str:
    """The embedded SmolLM2 as an HF directory holding only what SGLang reads: Tidal's cache
    directory also holds Tidal's own laid-out `tidal-*.safetensors`, which SGLang would load."""
    src = gguf_to_hf_dir(embedded_model_path())
    out = Path(tempfile.gettempdir()) / f"tidal-sglang-model-{src.name}"
    out.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists() and not (out / name).exists():
            (out / name).symlink_to(src / name)
    return str(out)


def model_and_python() -> tuple[str, str]:
    model = os.environ.get("TIDAL_SGLANG_MODEL", "embedded")
    if model == "embedded":
        model = embedded_hf_dir()
    if not Path(model, "config.json").exists():
        pytest.fail(f"TIDAL_SGLANG_MODEL={model} is not a Hugging Face model directory")
    python = os.environ.get("TIDAL_SGLANG_PYTHON", sys.executable)
    found = subprocess.run([python, "-c", "import sglang"], capture_output=True, timeout=300)
    if found.returncode != 0:
        pytest.fail(f"{python} cannot import sglang; set TIDAL_SGLANG_PYTHON (make test-sglang)")
    return model, python


@contextlib.contextmanager
def tidal_over(
    servers: list[SglangProcess], model: str, up_args: list[str]
) -> Iterator[SglangStack]:
    """`tidal up --engine sglang` over `servers` (started here, stopped at the end)."""
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
        argv += [*up_args, "--cpu-attn", "0", "--store-dir", str(tmp / "js")]
        with open(tmp / "up.log", "w") as log:
            proc = subprocess.Popen(
                [*argv, "--log-level", "INFO"], stdout=log, stderr=subprocess.STDOUT, env=env
            )
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
