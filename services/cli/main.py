"""The `tidal` command: one entry point for the stack, the control plane and the tools."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

# Modules that add subcommands with `register(subparsers)`; a missing optional one is skipped so
# the command works while parts of the core are still being built.
_COMMANDS = (
    "services.cli.up",
    "services.cli.ctl",
    "services.cli.batch",
    "tidal.perf.cli",
    "tidal.sim.cli",
)
# `tidal bench` is the measurement package, apart from the product (the `bench` extra): imported
# only when `tidal bench` runs.
_BENCH = "tidal_bench.cli"
_BENCH_HELP = "benchmarks (the tidal_bench package, the `bench` extra)"


def build_parser(bench: ModuleType | None = None) -> argparse.ArgumentParser:
    """The `tidal` parser; `bench` is `tidal_bench.cli` to add `tidal bench`'s commands (without
    it, `bench` is only listed)."""
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
    if bench is not None:
        bench.register(sub)
    else:
        sub.add_parser("bench", help=_BENCH_HELP, add_help=False)
    return parser


def _bench() -> ModuleType | None:
    """`tidal_bench.cli`, or None after saying how to install it."""
    try:
        return importlib.import_module(_BENCH)
    except ModuleNotFoundError as exc:
        print(
            f"tidal bench: {exc}: the benchmarks are the `bench` extra, "
            "pip install 'tidal-serve[bench]' (from a checkout: pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = _bench() if argv[:1] == ["bench"] else None
    if argv[:1] == ["bench"] and bench is None:
        return 2
    args = build_parser(bench).parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:  # bad input: say what, not a traceback
        print(f"tidal {argv[0] if argv else ''}: error: {exc}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
