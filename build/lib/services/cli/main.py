"""The `tidal` command: one entry point for the stack, the control plane and the tools."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add subcommands with `register(subparsers)`; a missing optional one is skipped so
# the command works while parts of the core are still being built.
_COMMANDS = (
    "services.cli.up",
    "services.cli.ctl",
    "services.cli.batch",
    "services.cli.bench",
    "tidal.perf.cli",
    "tidal.sim.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
