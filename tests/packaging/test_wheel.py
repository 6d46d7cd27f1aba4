"""The package as a user installs it: the wheel built from this checkout, installed with its
control-plane dependencies only (no extras: no torch, no matplotlib, no openai) into a fresh
virtualenv, serves a chat with `tidal up --engine sim` started from a directory outside the
repository. Dependencies come through the machine's own pip configuration. Runs on this Python
(3.11) and on every other supported one the machine has (3.12, 3.13)."""

from __future__ import annotations

import glob
import os
import shutil
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
OTHER_PYTHONS = ("3.12", "3.13")
PACKAGED = ("pyproject.toml", "README.md", "LICENSE", "tidal", "services", "tidal_bench")


def _python(version: str) -> str | None:
    """An interpreter of `version` that runs: on PATH, or one pyenv has installed."""
    candidates = [shutil.which(f"python{version}") or ""]
    candidates += sorted(
        glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python3"))
    )
    for c in candidates:
        if c and subprocess.run([c, "-c", ""], capture_output=True).returncode == 0:
            return c
    return None


PYTHONS = {"3.11": sys.executable} | {v: p for v in OTHER_PYTHONS if (p := _python(v))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # NOTE: built from a copy of what the package holds: setuptools writes build/ and *.egg-info
    # beside the sources it builds, which must not land in the checkout.
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in PACKAGED:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src, cwd=dist)
    (whl,) = dist.glob("tidal_serve-*.whl")
    return whl


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


@pytest.mark.parametrize("version", sorted(PYTHONS))
def test_wheel_in_a_fresh_venv_serves_a_chat(tmp_path: Path, wheel: Path, version: str) -> None:
    venv, outside = tmp_path / "venv", tmp_path / "somewhere"
    outside.mkdir()
    _run(PYTHONS[version], "-m", "venv", venv, cwd=tmp_path)
    py = venv / "bin" / "python"
    assert _run(py, "-c", "import sys; print(sys.version)", cwd=outside).startswith(version)
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
