"""The package as a user installs it: the wheel built from this checkout, installed with its
control-plane dependencies only (no extras: no torch, no matplotlib, no openai) into a fresh
virtualenv, serves a chat with `tidal up --engine sim` started from a directory outside the
repository. Dependencies come through the machine's own pip configuration."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from services.cli import natsd

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str | Path, cwd: Path, timeout: float = 300) -> str:
    out = subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200 and b'"id"' in resp.read()
    except OSError:
        return False


def test_wheel_in_a_fresh_venv_serves_a_chat(tmp_path: Path) -> None:
    dist, venv, outside = tmp_path / "dist", tmp_path / "venv", tmp_path / "somewhere"
    outside.mkdir()
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, REPO, cwd=tmp_path)
    (wheel,) = dist.glob("tidal_serve-*.whl")
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    py = venv / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", wheel, cwd=outside, timeout=600)
    probe = "import importlib.util as u; print([m for m in {} if u.find_spec(m)])"
    extras = ("torch", "matplotlib", "openai", "transformers")
    assert _run(py, "-c", probe.format(extras), cwd=outside).strip() == "[]"

    port = natsd.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TIDAL_"))}
    env |= {"TIDAL_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [venv / "bin" / "tidal", "up", "--engine", "sim", "--port", str(port)],
        cwd=outside,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 90
        while not _ready(base + "/models"):
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30)
        chat = client.chat.completions.create(
            model="tidal-sim", messages=[{"role": "user", "content": "Hello"}], max_tokens=8
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 8
    finally:
        os.killpg(up.pid, signal.SIGINT)
        code = up.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "up.log").read_text()[-3000:]
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not (site / "configs").exists()  # the configs ship inside the package
    assert (site / "tidal" / "configs" / "embedded.yaml").is_file()
