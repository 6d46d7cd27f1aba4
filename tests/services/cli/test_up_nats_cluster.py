"""`tidal up --nats-cluster N`: the nodes' command lines (routes, stores, ports) and bad N."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.cli import natsd

ROOT = Path(__file__).resolve().parents[3]


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_three_nodes_in_a_full_mesh_each_with_its_own_store(tmp_path: Path) -> None:
    nodes = natsd.cluster_nodes(3, str(tmp_path), auth_token="tok")
    assert [n.name for n in nodes] == ["nats-1", "nats-2", "nats-3"]
    route_ports = [_opt(n.argv, "--cluster").rsplit(":", 1)[1] for n in nodes]
    for n in nodes:
        assert "-js" in n.argv and _opt(n.argv, "-sd") == str(tmp_path / n.name)
        assert _opt(n.argv, "--server_name") == n.name
        assert _opt(n.argv, "--routes") == ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)
        assert int(_opt(n.argv, "-p")) == n.port and int(_opt(n.argv, "-m")) == n.monitor_port
        assert "tok" not in " ".join(n.argv)  # the token is in the 0600 config file only
        assert (tmp_path / n.name / "nats-server.conf").stat().st_mode & 0o077 == 0
    ports = [p for n in nodes for p in (n.port, n.monitor_port)] + [int(p) for p in route_ports]
    assert len(set(ports)) == 9


def test_a_cluster_of_two_is_refused_with_the_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "up", "--nats-cluster", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--nats-cluster takes 3 to 7 nodes" in out.stderr
