"""Bind and advertise addresses: a service bound to every interface never advertises loopback."""

from __future__ import annotations

import argparse

import pytest

from services.cli.up import Supervisor
from services.common import net
from services.cpu_attn.main import parse_args as cpu_attn_args
from services.instance.main import parse_args as instance_args


def fake_probe(routes: dict[str, str]) -> net.RouteProbe:
    return lambda host, port: routes.get(host)


def test_bus_endpoints_parses_a_seed_list_and_drops_credentials() -> None:
    url = "nats://tok@10.0.0.1:4222, nats://user:pw@nats-b:5222,nats-c"
    assert net.bus_endpoints(url) == [("10.0.0.1", 4222), ("nats-b", 5222), ("nats-c", 4222)]
    with pytest.raises(ValueError, match="names no server"):
        net.bus_endpoints(" , ")
    with pytest.raises(ValueError, match="is not a NATS server URL"):
        net.bus_endpoints("nats://:4222")


def test_bind_defaults_to_loopback_only_when_the_bus_is_on_loopback() -> None:
    assert net.default_bind_host("nats://127.0.0.1:4222") == "127.0.0.1"
    assert net.default_bind_host("nats://localhost:4222,nats://127.0.0.2:4223") == "127.0.0.1"
    assert net.default_bind_host("nats://10.0.0.1:4222") == "0.0.0.0"
    assert net.default_bind_host("nats://127.0.0.1:4222,nats://10.0.0.1:4222") == "0.0.0.0"


def test_an_explicit_address_wins_and_a_specific_bind_is_advertised_as_is() -> None:
    probe = fake_probe({"10.0.0.1": "10.0.0.2"})
    url = "nats://10.0.0.1:4222"
    assert net.resolve_advertise_host("0.0.0.0", "inst-a.svc", url, probe=probe) == "inst-a.svc"
    assert net.resolve_advertise_host("10.9.9.9", "", url, probe=probe) == "10.9.9.9"
    assert net.resolve_advertise_host("127.0.0.1", "", url, probe=probe) == "127.0.0.1"


def test_bound_to_every_interface_it_advertises_the_interface_that_routes_to_the_bus() -> None:
    probe = fake_probe({"10.0.0.1": "10.0.0.2", "192.0.2.1": "172.16.0.5"})
    got = net.resolve_advertise_host("0.0.0.0", "", "nats://10.0.0.1:4222", probe=probe)
    assert got == "10.0.0.2"
    # The first seed has no route; the second one does.
    url = "nats://10.1.0.1:4222,nats://10.0.0.1:4222"
    assert net.resolve_advertise_host("", "", url, probe=probe) == "10.0.0.2"


def test_bus_on_loopback_and_bound_to_every_interface_never_advertises_loopback() -> None:
    probe = fake_probe({"127.0.0.1": "127.0.0.1", "192.0.2.1": "172.16.0.5"})
    url = "nats://127.0.0.1:4222"
    assert net.resolve_advertise_host("0.0.0.0", "", url, probe=probe) == "172.16.0.5"
    no_default_route = fake_probe({"127.0.0.1": "127.0.0.1"})
    got = net.resolve_advertise_host(
        "0.0.0.0", "", url, probe=no_default_route, host_addresses=lambda: ["127.0.1.1", "10.3.3.3"]
    )
    assert got == "10.3.3.3"
    alone = net.resolve_advertise_host(
        "0.0.0.0", "", url, probe=no_default_route, host_addresses=lambda: []
    )
    assert alone == "127.0.0.1"  # a host with no other address: loopback is all there is


def test_route_source_asks_the_kernel_without_sending() -> None:
    assert net.route_source("127.0.0.1", 9) == "127.0.0.1"
    assert net.route_source("no-such-host.invalid", 9) is None


def test_advertise_host_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_ADVERTISE_HOST", "10.7.0.3")
    assert instance_args([]).advertise_host == "10.7.0.3"
    assert cpu_attn_args([]).advertise_host == "10.7.0.3"
    assert instance_args(["--advertise-host", "h1"]).advertise_host == "h1"
    assert instance_args([]).data_host == ""  # auto: follows where the bus is


def test_tidal_up_threads_bind_and_advertise_addresses_to_every_data_plane() -> None:
    from services.cli.main import build_parser

    args = build_parser().parse_args(
        ["up", "--engine", "sim", "--data-host", "0.0.0.0", "--advertise-host", "10.7.0.3"]
    )
    assert isinstance(args, argparse.Namespace)
    children = Supervisor(args).plan()
    by_name = {c.name: c.argv for c in children}
    for name in ("instance-0", "cpu-attn-0"):
        argv = by_name[name]
        assert argv[argv.index("--advertise-host") + 1] == "10.7.0.3"
    inst = by_name["instance-0"]
    assert inst[inst.index("--data-host") + 1] == "0.0.0.0"
    cpu = by_name["cpu-attn-0"]
    assert cpu[cpu.index("--host") + 1] == "0.0.0.0"
