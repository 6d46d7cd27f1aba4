"""The plan contract stands alone: `tidal.engine` imports nothing from `tidal.policy` and
`tidal.policy` nothing from `tidal.engine`; both take the plan types from `tidal.plan`, which
imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "tidal"


def imported_modules(package: str) -> dict[str, set[str]]:
    """file -> modules it imports (absolute names), for every .py file under tidal/<package>."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[str(path.relative_to(ROOT.parent))] = names
    return out


def arrows(src: str, dst: str) -> list[str]:
    return [
        f"{f} -> {m}"
        for f, mods in imported_modules(src).items()
        for m in sorted(mods)
        if m == f"tidal.{dst}" or m.startswith(f"tidal.{dst}.")
    ]


def test_engine_imports_nothing_from_policy() -> None:
    assert arrows("engine", "policy") == []


def test_policy_imports_nothing_from_engine() -> None:
    assert arrows("policy", "engine") == []


def test_plan_imports_neither_side() -> None:
    assert arrows("plan", "policy") == [] and arrows("plan", "engine") == []
    assert arrows("plan", "sim") == []


def test_the_check_sees_an_arrow_where_there_is_one() -> None:
    assert any(a.endswith("-> tidal.plan") for a in arrows("engine", "plan"))
