"""Hosts on one machine: Linux network namespaces on a bridge, each its own address, reaching the
others only over the (virtual) network.

    root ns ── bridge tdbrN (10.R.N.254/24) ─┬─ veth ── ns h0 (10.R.N.1, eth0)
                                             ├─ veth ── ns h1 (10.R.N.2)
                                             └─ veth ── ns h2 (10.R.N.3)

The bridge's own address lets the root namespace (the test) reach every host; the subnet gets no
default route, so nothing leaks past the bridge. `cut(host)` takes a host's link down (a
partition), `heal(host)` brings it back, `kill_host(host)` kills -9 every process in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "tests/cluster needs root (network namespaces); run as root, as CI does"
    if shutil.which("ip") is None:
        return "tests/cluster needs the `ip` command (iproute2)"
    probe = f"tdprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@dataclass
class Hosts:
    num_hosts: int
    tag: str = field(default_factory=lambda: str(os.getpid() % 1000))
    names: list[str] = field(default_factory=list)  # namespace per host
    addrs: list[str] = field(default_factory=list)  # address per host
    links: list[str] = field(default_factory=list)  # root-side veth per host

    @property
    def bridge(self) -> str:
        return f"tdbr{self.tag}"

    def subnet(self) -> str:
        # 10.213.X.0/24, X from the tag: parallel runs on one machine do not collide.
        return f"10.213.{int(self.tag) % 250}"

    def create(self) -> None:
        net = self.subnet()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{net}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.num_hosts):
            ns, root_end, addr = f"td{self.tag}h{i}", f"td{self.tag}v{i}", f"{net}.{i + 1}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            _ip("link", "add", root_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.links.append(root_end)
            _ip("link", "set", root_end, "master", self.bridge)
            _ip("link", "set", root_end, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.addrs.append(addr)

    def destroy(self) -> None:
        for i in range(len(self.names)):
            self.kill_host(i)
        for ns in self.names:
            _ip("netns", "del", ns, check=False)
        for link in self.links:
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.names, self.links, self.addrs = [], [], []

    def argv(self, host: int, *cmd: str) -> list[str]:
        """`cmd` run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.names[host], *cmd]

    def pids(self, host: int) -> list[int]:
        out = _ip("netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: int) -> int:
        """kill -9 every process in the host; returns how many there were."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def cut(self, host: int) -> None:
        _ip("link", "set", self.links[host], "down")

    def heal(self, host: int) -> None:
        _ip("link", "set", self.links[host], "up")
