"""deploy/k8s: rendered by `kubectl kustomize` (offline), every object valid against the Kubernetes
schemas (kubernetes-validate, strict: no unknown fields), and every command a Tidal container
runs is one its service's argparse accepts, with env it reads."""

from __future__ import annotations

import base64
import importlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.gateway.auth import API_KEYS_ENV
from tidal import envs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The kubectl on this machine is 1.32; the newest schemas the validator ships are checked too.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())
# What the downward API and the Secret give a pod, for expanding $(VAR) in a command.
FIELD_VALUES = {
    "metadata.name": "instance-1",
    "metadata.labels['apps.kubernetes.io/pod-index']": "1",
    "status.podIP": "10.1.2.3",
}
TIDAL_ENV = {v.name for v in envs.ALL} | {API_KEYS_ENV}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed"
)


def render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(K8S)


@pytest.fixture(scope="module")
def gpu() -> list[dict[str, Any]]:
    return render(K8S / "overlays" / "gpu")


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def expanded_env(c: dict[str, Any], secrets: dict[str, str]) -> dict[str, str]:
    """The container's env as the kubelet makes it: in order, $(VAR) of an earlier one
    expanded. A reference to a variable not defined before it fails the test (the kubelet
    would leave the text `$(VAR)` in place, silently)."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env, f"env {e['name']}")
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = FIELD_VALUES[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = secrets[e["valueFrom"]["secretKeyRef"]["key"]]
    return env


def secrets_of(objs: list[dict[str, Any]]) -> dict[str, str]:
    (secret,) = [o for o in objs if o["kind"] == "Secret"]
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def argv_of(c: dict[str, Any], env: dict[str, str]) -> list[str]:
    return [expand(a, env, f"{c['name']} command") for a in c["command"]]


def expand(text: str, env: dict[str, str], where: str) -> str:
    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not defined before it"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(
    base: list[dict[str, Any]], gpu: list[dict[str, Any]], version: str
) -> None:
    for obj in [*base, *gpu]:
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any error
    kinds = sorted(o["kind"] for o in base)
    assert kinds.count("StatefulSet") == 3  # nats, instance, cpu-attn
    assert {"Namespace", "Secret", "NetworkPolicy", "PodDisruptionBudget"} <= set(kinds)
    assert all(o["metadata"].get("namespace") == "tidal" for o in base if o["kind"] != "Namespace")


def test_nats_is_a_three_node_jetstream_cluster_with_routes(base: list[dict[str, Any]]) -> None:
    sts = named(base, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    conf = named(base, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert "jetstream" in conf and "store_dir: /data/jetstream" in conf
    routes = re.findall(r"nats://(nats-\d)\.nats-headless:6222", conf)
    assert routes == ["nats-0", "nats-1", "nats-2"]
    assert named(base, "Service", "nats-headless")["spec"]["clusterIP"] == "None"
    # every Tidal service creates its streams and buckets with 3 replicas
    env_cm = next(
        o for o in base if o["kind"] == "ConfigMap" and "TIDAL_NATS_REPLICAS" in o["data"]
    )
    assert env_cm["data"]["TIDAL_NATS_REPLICAS"] == "3"


def test_every_tidal_command_is_accepted_by_its_service(base: list[dict[str, Any]]) -> None:
    secrets = secrets_of(base)
    roles: dict[str, str] = {}
    for obj in workloads(base):
        c = container(obj)
        if c["image"].split(":")[0] != "tidal":
            continue
        env = expanded_env(c, secrets)
        argv = argv_of(c, env)
        assert argv[:2] == ["python", "-m"] and argv[2].startswith("services.")
        module = importlib.import_module(f"{argv[2]}.main")
        args = module.parse_args(argv[3:])  # argparse exits (failing the test) on a bad flag
        # every TIDAL_* variable set is one Tidal reads; the bus is the 3-node seed list
        assert {k for k in env if k.startswith("TIDAL_")} <= TIDAL_ENV, obj["metadata"]["name"]
        seeds = env["TIDAL_NATS_URL"].split(",")
        assert len(seeds) == 3 and all(u.startswith("nats://tidal:change-me@nats-") for u in seeds)
        assert c["envFrom"][0]["configMapRef"]["name"].startswith("tidal-env")
        if argv[2] == "services.instance":
            assert args.data_host == FIELD_VALUES["status.podIP"]  # advertised to the others
            assert args.index == 1  # from the pod-index label
            roles["instance"] = args.roles
            assert len(args.roles.split(",")) == obj["spec"]["replicas"]
        if argv[2] == "services.scheduler":
            roles["scheduler"] = args.roles
        if argv[2] == "services.cpu_attn":
            assert args.advertise_host == FIELD_VALUES["status.podIP"]
            assert args.host == "0.0.0.0"
        if argv[2] == "services.gateway":
            assert args.host == "0.0.0.0"
            assert {e["name"] for e in c["env"]} >= {API_KEYS_ENV}
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["readinessProbe"]["httpGet"]["port"] == args.port
    assert roles["instance"] == roles["scheduler"]  # slot N of the scheduler is pod N


def test_only_the_gateway_takes_connections_from_outside(base: list[dict[str, Any]]) -> None:
    policies = [o["spec"] for o in base if o["kind"] == "NetworkPolicy"]
    deny_all = [p for p in policies if p["podSelector"] == {} and not p.get("ingress")]
    assert deny_all, "no default-deny ingress policy"
    for p in policies:
        for rule in p.get("ingress", []):
            if "from" in rule:  # only peers of the namespace itself
                assert all(peer == {"podSelector": {}} for peer in rule["from"])
            else:  # open to anyone: the gateway's API port only
                assert p["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "gateway"}}
                assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    exposed = [o for o in base if o["kind"] == "Service" and o["spec"].get("type")]
    assert exposed == []  # nothing is a NodePort or LoadBalancer


def test_the_gpu_overlay_gives_each_instance_one_gpu(gpu: list[dict[str, Any]]) -> None:
    for obj in workloads(gpu):
        c = container(obj)
        asks_gpu = "nvidia.com/gpu" in c["resources"].get("limits", {})
        assert asks_gpu == (obj["metadata"]["name"] == "instance")
    c = container(named(gpu, "StatefulSet", "instance"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    module = importlib.import_module("services.instance.main")
    args = module.parse_args(argv_of(c, expanded_env(c, secrets_of(gpu)))[3:])
    assert args.device == "cuda"
