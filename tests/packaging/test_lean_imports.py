"""The control plane imports without the extras: `tidal`'s parser, the gateway, scheduler, batch
service and a `sim` instance load with torch, matplotlib, openai and transformers made
unimportable, as in a `pip install tidal-serve` without extras."""

from __future__ import annotations

import subprocess
import sys
import textwrap

EXTRAS_ONLY = ("torch", "matplotlib", "openai", "transformers", "safetensors")

PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    from services.cli.main import main

    for argv in (["up", "--help"], ["bench", "faults", "--help"], ["ctl", "--help"]):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0, argv
        else:
            raise AssertionError(argv)
    for name in ("services.gateway.main", "services.scheduler.main", "services.batch.main",
                 "services.instance.main"):
        importlib.import_module(name)
    from services.instance.engines import build_engine
    from services.instance.main import parse_args

    args = parse_args(["--id", "i0", "--engine", "sim"])
    engine = build_engine(args)
    print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
    """
)


def test_control_plane_imports_without_extras() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(blocked=set(EXTRAS_ONLY))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout
