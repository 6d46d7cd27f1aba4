"""The tree's layers, checked: no import circle between any two modules (imports made only for
type checking included: a circle there is still two ideas that cannot be read apart), and every
import goes down the layers: the core (`tidal/`) imports no service and no benchmark; a service
(`services/<name>/`) imports the core, `services/common` and itself, never another service; the
CLI (`services/cli`) may start any service; measurement (`tidal_bench/`) may import anything,
and the product imports it only where `tidal bench` loads it on demand.

Run it alone (`pytest tests/test_layering.py -q -rA`) to see the graph's size and any finding."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tidal", "services", "tidal_bench")
# the one place the product reaches measurement: `tidal bench`, imported when it is used
BENCH_ENTRY = {"services.cli.main"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules of this tree that `name` imports, anywhere in it (functions and
    `TYPE_CHECKING` blocks too), each resolved to the longest module that exists."""
    known = set(known)
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                up = here[: len(here) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            # a module importing its own package's __init__ is no arrow between two ideas
            if n and n != name and not name.startswith(n + "."):
                out.add(n)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


def layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if m.split(".")[0] == "tidal" and d.split(".")[0] in ("services", "tidal_bench"):
                out.append(f"core {m} -> {d}")
            elif m.startswith("services.") and d.startswith("tidal_bench") and m not in BENCH_ENTRY:
                out.append(f"product {m} -> {d}")
            elif m.startswith("services.") and d.startswith("services."):
                mine, theirs = m.split(".")[1], d.split(".")[1]
                if mine not in ("cli", theirs) and theirs != "common":
                    out.append(f"service {m} -> {d}")
    return out


def test_no_import_circles() -> None:
    graph = import_graph()
    found = circles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, circles: {found}")
    assert found == []


def test_imports_go_down_the_layers() -> None:
    graph = import_graph()
    assert layer_breaks(graph) == []


def test_the_checks_see_a_circle_and_a_break_where_there_is_one() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}}
    assert circles(g) == [["a", "b", "c"], ["e", "e2"]]
    graph = {
        "tidal.x": {"services.gateway.app"},
        "services.batch.run": {"services.gateway.bus", "services.common.bus"},
        "services.cli.up": {"services.gateway.app"},
        "services.instance.main": {"tidal_bench.cli"},
    }
    assert layer_breaks(graph) == [
        "service services.batch.run -> services.gateway.bus",
        "product services.instance.main -> tidal_bench.cli",
        "core tidal.x -> services.gateway.app",
    ]
