"""Command-line flags more than one service takes, declared once: the bus every service joins,
the address a data plane listens on and the one other hosts reach it on (instances,
CPU-attention workers, `tidal up`)."""

from __future__ import annotations

import argparse

from tidal import envs


def add_bus_args(p: argparse.ArgumentParser) -> None:
    """`--nats-url` and `--connect-timeout-s`."""
    p.add_argument("--nats-url", default=envs.NATS_URL.get(), help="NATS server to join")
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=10.0,
        help="give up joining the bus after this long",
    )


def add_advertise_host(p: argparse.ArgumentParser) -> None:
    """`--advertise-host`."""
    p.add_argument(
        "--advertise-host",
        default=envs.ADVERTISE_HOST.get(),
        help="address other hosts reach this host's data plane on (also $TIDAL_ADVERTISE_HOST; "
        "default: the address it listens on, or when that is 0.0.0.0 the interface that routes "
        "to NATS; docs/cluster.md)",
    )


def add_listen_host(p: argparse.ArgumentParser, listener: str, flag: str = "--data-host") -> None:
    """`--data-host` (or `flag`): the address `listener` (e.g. "the KV data plane listens")
    on."""
    p.add_argument(
        flag,
        default="",
        help=f"address {listener} on (default: 127.0.0.1 when the bus is on loopback, else "
        "0.0.0.0)",
    )
