"""A Tidal cluster over network namespaces: NATS, scheduler, batch and gateway on host 0, a
relaxed instance on host 1 and a strict one on host 2 (sim engine), each started with
`ip netns exec` and the bus URL of host 0 — no address given by hand: every data plane binds
0.0.0.0 and advertises the interface that routes to NATS. Skipped (with the reason printed)
when not root or `ip netns` is unavailable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.cli import natsd
from tests.cluster.netns import Hosts, unavailable_reason

NATS_PORT = 4222
NATS_ROUTE_PORT = 6222
NATS_MONITOR_PORT = 8222
API_PORT = 8000
ROLES = "relaxed,strict"
STEP_MODEL = "linear:0.01,0,0,0"  # 10 ms per emulated step: streams last seconds
HEARTBEAT_S = "0.2"


SKIPPED: list[str] = []  # why tests/cluster did not run here, for the session's summary


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mine = [item for item in items if "tests/cluster/" in str(item.fspath)]
    if not mine:
        return
    reason = unavailable_reason()
    if not reason:
        return
    SKIPPED.append(reason)
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=reason))


@dataclass
class Cluster:
    hosts: Hosts
    tmp: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    host_of: dict[str, int] = field(default_factory=dict)
    nats_hosts: list[int] = field(default_factory=lambda: [0])  # a NATS node on each
    env: dict[str, str] = field(default_factory=dict)  # given to every service
    nats_argv: dict[str, list[str]] = field(default_factory=dict)  # node name -> its argv

    @property
    def nats_url(self) -> str:
        """Every node's URL, comma-separated (the seed list the services take)."""
        return ",".join(f"nats://{self.hosts.addrs[h]}:{NATS_PORT}" for h in self.nats_hosts)

    @property
    def api(self) -> str:
        return f"http://{self.hosts.addrs[0]}:{API_PORT}"

    def start(self, name: str, host: int, *argv: str) -> None:
        env = {
            **os.environ,
            "TIDAL_NATS_URL": self.nats_url,
            "TIDAL_HEARTBEAT_S": HEARTBEAT_S,
            "TIDAL_LOG_LEVEL": "INFO",
            "NO_PROXY": "*",
            **self.env,
        }
        env.pop("TIDAL_ADVERTISE_HOST", None)
        with open(self.tmp / f"{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                self.hosts.argv(host, *argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.host_of[name] = host

    def service(self, name: str, host: int, module: str, *extra: str) -> None:
        self.start(name, host, sys.executable, "-m", module, "--id", name, *extra)

    def instance(self, index: int, host: int, *cfg: str, step_model: str = STEP_MODEL) -> None:
        """The sim-engine instance at slot `index` on `host`; `cfg`: the cluster's config flags
        (default: the tidal policy with ROLES)."""
        cfg = cfg or ("--policy", "tidal", "--roles", ROLES)
        self.service(
            f"instance-{index}",
            host,
            "services.instance",
            *("--index", str(index), "--engine", "sim", *cfg, "--sim-step-model", step_model),
        )

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs_tail(self, n: int = 30) -> str:
        out = []
        for name in self.procs:
            lines = self.log(name).splitlines()[-n:]
            out.append(f"--- {name} ---\n" + "\n".join(lines))
        return "\n".join(out)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.api + path, timeout=2) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError:
            return 0, b""

    def nats_current(self, host: int, timeout_s: float) -> bool:
        """Whether host `host`'s NATS node answers /healthz 200 (JetStream current with the
        cluster: meta, streams, consumers) within `timeout_s`."""
        url = f"http://{self.hosts.addrs[host]}:{NATS_MONITOR_PORT}/healthz"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with opener.open(url, timeout=1) as resp:
                    if resp.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def wait_ready(self, num_instances: int, timeout_s: float = 60.0) -> float:
        """Seconds until the gateway is ready with `num_instances` instances heard from."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            status, body = self.get("/ready")
            if status == 200 and body.count(b'"instance-') >= num_instances:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"cluster not ready in {timeout_s:.0f} s\n{self.logs_tail()}")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    hosts = Hosts(3)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-cluster-"))
    c = Cluster(hosts, tmp)
    try:
        hosts.create()
        store = tmp / "jetstream"
        store.mkdir()
        c.start("nats-server", 0, *natsd.nats_server_argv(NATS_PORT, str(store), host="0.0.0.0"))
        if not natsd.wait_for_port(hosts.addrs[0], NATS_PORT, 10):
            raise AssertionError(f"nats-server did not start\n{c.logs_tail()}")
        _start_services(c)
        yield c
    finally:
        _teardown(c)


def _start_services(c: Cluster) -> None:
    """Scheduler, batch and gateway on h0, the relaxed instance on h1 and the strict one on h2,
    once the bus is up; returns when both instances serve."""
    c.service("scheduler-0", 0, "services.scheduler", "--policy", "tidal", "--roles", ROLES)
    c.service("batch-0", 0, "services.batch")
    c.service("gateway-0", 0, "services.gateway", "--host", "0.0.0.0", "--port", str(API_PORT))
    c.instance(0, 1)
    c.instance(1, 2)
    c.wait_ready(2)


def _teardown(c: Cluster) -> None:
    for i in range(len(c.hosts.names)):
        c.hosts.kill_host(i)
    for p in c.procs.values():
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
    c.hosts.destroy()
    if os.environ.get("TIDAL_KEEP_CLUSTER_LOGS"):
        print(f"cluster logs kept in {c.tmp}")
    else:
        shutil.rmtree(c.tmp, ignore_errors=True)


def nats_node_argv(hosts: Hosts, host: int, store: Path) -> list[str]:
    """nats-N on host N-1: clients on NATS_PORT, routes to every host's node, monitoring
    (/healthz) on NATS_MONITOR_PORT, JetStream under `store`."""
    routes = ",".join(f"nats://{a}:{NATS_ROUTE_PORT}" for a in hosts.addrs)
    store.mkdir(parents=True, exist_ok=True)
    cluster = ["--server_name", f"nats-{host + 1}", "--cluster_name", "tidal",
               "--cluster", f"nats://0.0.0.0:{NATS_ROUTE_PORT}", "--routes", routes,
               "-m", str(NATS_MONITOR_PORT)]  # fmt: skip
    return natsd.nats_server_argv(NATS_PORT, str(store), host="0.0.0.0", extra=cluster)


def start_nats_nodes(c: Cluster, current_within_s: float) -> None:
    """nats-N on host N-1 for each of `c.nats_hosts`; returns once every node is current."""
    for h in c.nats_hosts:
        name = f"nats-{h + 1}"
        c.nats_argv[name] = nats_node_argv(c.hosts, h, c.tmp / name)
        c.start(name, h, *c.nats_argv[name])
    for h in c.nats_hosts:
        if not c.nats_current(h, current_within_s):
            raise AssertionError(f"nats-{h + 1} not current\n{c.logs_tail()}")


@pytest.fixture
def nats_spread_cluster() -> Iterator[Cluster]:
    """As `cluster`, but NATS is a 3-node JetStream cluster, one node per host (h0, h1, h2,
    routes between them), the services given all three seed URLs and R=3 streams."""
    hosts = Hosts(3)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-cluster-"))
    c = Cluster(hosts, tmp, nats_hosts=[0, 1, 2], env={"TIDAL_NATS_REPLICAS": "3"})
    try:
        hosts.create()
        start_nats_nodes(c, current_within_s=20)
        _start_services(c)
        yield c
    finally:
        _teardown(c)


# The real-size layout (tests/cluster/test_cut_links.py): a NATS node on every host, the gateway
# and the scheduler on hosts of their own, so that each can be cut alone.
GATEWAY_HOST, SCHEDULER_HOST, RELAXED_HOST, STRICT_HOST = 0, 1, 2, 3
REAL_CONFIG = ("--config", "configs/ooco.yaml", "--policy", "tidal")
REAL_STEP_MODEL = "qwen2.5-7b@a100-80gb"
REAL_MAX_HOLD_S = 60


@pytest.fixture
def real_size_cluster() -> Iterator[Cluster]:
    """Four hosts, a NATS node on each (4-node JetStream cluster, R=3 streams), every service
    given the same four seeds: h0 gateway + batch, h1 scheduler, h2 the relaxed instance, h3
    the strict one; `configs/ooco.yaml` with the tidal policy, the sim engine emulating
    Qwen2.5-7B on an A100 (real step times and KV sizes)."""
    hosts = Hosts(4)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-cluster-"))
    env = {"TIDAL_NATS_REPLICAS": "3", "TIDAL_MAX_HOLD_S": str(REAL_MAX_HOLD_S)}
    c = Cluster(hosts, tmp, nats_hosts=[0, 1, 2, 3], env=env)
    try:
        hosts.create()
        start_nats_nodes(c, current_within_s=30)
        c.service("scheduler-0", SCHEDULER_HOST, "services.scheduler", *REAL_CONFIG)
        c.service("batch-0", GATEWAY_HOST, "services.batch")
        gw = ("--host", "0.0.0.0", "--port", str(API_PORT))
        c.service("gateway-0", GATEWAY_HOST, "services.gateway", *gw)
        inst = (*REAL_CONFIG, "--max-model-len", "40000")
        c.instance(0, RELAXED_HOST, *inst, step_model=REAL_STEP_MODEL)
        c.instance(1, STRICT_HOST, *inst, step_model=REAL_STEP_MODEL)
        c.wait_ready(2)
        yield c
    finally:
        _teardown(c)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    from tests.cluster.kit import RESULTS

    tr = terminalreporter
    if SKIPPED:
        tr.section("multi-host cases (network namespaces)")
        tr.write_line(f"tests/cluster skipped: {SKIPPED[0]}")
    if not RESULTS:
        return
    tr.section("multi-host cases (network namespaces)")
    tr.write_line("case | hosts | load | lost | duplicated | recovery_s | note")
    for r in RESULTS:
        tr.write_line(
            f"{r['case']} | {r['hosts']} | {r['load']} | {r['lost']} | {r['duplicated']} | "
            f"{r['recovery_s']} | {r.get('note', '')}"
        )
