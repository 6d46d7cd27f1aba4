"""`tidal serve DIR`, as `vllm serve DIR`: a local Hugging Face directory served by the torch
engine through the whole stack, under the name given by --served-model-name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from services.cli import natsd
from services.cli.main import main
from tests.tidal.engine.hf_dir import write_hf_dir

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.slow]
NAME = "my-tiny-llama"


def test_serve_a_local_hf_directory(tmp_path: Path) -> None:
    model = write_hf_dir(tmp_path / "tiny-llama", "llama")
    port = natsd.free_port()
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp_path / "up.json")}
    argv = [str(Path(sys.executable).parent / "tidal"), "serve", str(model)]
    argv += ["--served-model-name", NAME, "--device", "cpu", "--dtype", "float32"]
    argv += ["--port", str(port), "--cpu-attn", "0", "--store-dir", str(tmp_path / "js")]
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        deadline = time.monotonic() + 180
        models: list[str] = []
        while not models and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            try:
                models = [m.id for m in client.models.list()]
            except openai.APIError:
                time.sleep(0.5)
        assert models == [NAME], (tmp_path / "up.log").read_text()[-3000:]
        chat = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.model == NAME and chat.system_fingerprint == "tidal-torch"
        assert chat.usage is not None and chat.usage.completion_tokens == 6
        # <user>hello<assistant>: one byte-level token per character of the template's output
        assert chat.usage.prompt_tokens == len("<user>hello<assistant>")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "x"}]
            )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "/nonexistent/model"], "does not exist: the torch engine serves a local"),
        (["up", "a", "--model", "b", "--engine", "sim"], "MODEL 'a' and --model 'b' disagree"),
        (["up", "--engine", "sim", "--device", "tpu"], "--device 'tpu': expected cpu, cuda"),
    ],
)
def test_bad_model_options_fail_before_anything_starts(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
