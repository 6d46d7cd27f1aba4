"""The image holds everything the services read: every path the compose commands name and the
code's defaults point at (tidal/configs/, data/) is in the build context after .dockerignore, and
the Dockerfile copies it; the context carries no venv, caches or history."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tidal.config import live as live_config
from tidal.workload import traces

ROOT = Path(__file__).resolve().parents[2]
APP = "/app"  # the Dockerfile's WORKDIR


def ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (is_exclusion, regex): Go filepath.Match syntax plus `**`, as Docker
    reads it; the last rule that matches a path (or a folder above it) decides."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((not negate, re.compile(regex + r"\Z")))
    return rules


def is_ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = rel.split("/")
    ancestors = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for excludes, regex in rules:
        if any(regex.match(a) for a in ancestors):
            ignored = excludes
    return ignored


def context_files() -> set[str]:
    """Every file the build context sends (those git knows of, as a fresh clone has them)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    rules = ignore_rules()
    return {f for f in out.stdout.splitlines() if (ROOT / f).exists() and not is_ignored(f, rules)}


def copies() -> dict[str, str]:
    """The Dockerfile's COPY instructions: source in the context -> destination in the image."""
    out: dict[str, str] = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, dest = line.split()[1:]
        for src in sources:
            full = dest if dest.startswith("/") else f"{APP}/{dest.removeprefix('./')}"
            out[src.rstrip("/")] = full
    return out


def copied_to(rel: str, table: dict[str, str]) -> str | None:
    """Where `rel` (a path in the repository) lands in the image, or None. COPY puts a file
    given with a destination ending in `/` inside it, and a folder's content into the dest."""
    for src, dest in table.items():
        if rel != src and not rel.startswith(src + "/"):
            continue
        target = dest.rstrip("/")
        if dest.endswith("/") and (ROOT / src).is_file():
            target = f"{target}/{Path(src).name}"
        tail = rel[len(src) :].lstrip("/")
        return f"{target}/{tail}" if tail else target
    return None


def needed_paths() -> set[str]:
    """Paths (relative to the repository) the services read: the code's defaults, and every
    repository path a compose command names."""
    needed = {
        "pyproject.toml",  # pip install
        "README.md",  # pyproject's readme
        "LICENSE",  # pyproject's license-files
        "tidal",
        "services",
        str(live_config.DEFAULT_CONFIG.relative_to(ROOT)),
        *(str(p.relative_to(ROOT)) for p in live_config.CONFIG_DIR.glob("*.yaml")),
        str((traces._REPO_ROOT / "data").relative_to(ROOT)),
    }
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        for arg in service.get("command", []):
            if isinstance(arg, str) and "/" in arg and (ROOT / arg).exists():
                needed.add(arg)
    return needed


def test_every_path_the_services_read_is_in_the_context_and_copied() -> None:
    files = context_files()
    table = copies()
    for rel in sorted(needed_paths()):
        if (ROOT / rel).is_dir():
            inside = {f for f in files if f.startswith(rel + "/")}
            tracked = subprocess.run(
                ["git", "ls-files", rel], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.split()
            assert inside >= set(tracked), f"{rel}: .dockerignore drops {set(tracked) - inside}"
        else:
            assert rel in files, f"{rel} is not in the build context"
        assert copied_to(rel, table) is not None, f"the Dockerfile does not copy {rel}"
    # where the code looks for them in the image
    assert copied_to("tidal/configs/embedded.yaml", table) == f"{APP}/tidal/configs/embedded.yaml"
    data_dir = re.search(r"TIDAL_DATA_DIR=(\S+)", (ROOT / "Dockerfile").read_text())
    assert data_dir is not None and copied_to("data", table) == data_dir.group(1)


def test_every_copy_source_is_in_the_context() -> None:
    files = context_files()
    for src in copies():
        assert any(f == src or f.startswith(src + "/") for f in files), src


def test_the_context_carries_no_venv_caches_or_history() -> None:
    rules = ignore_rules()
    for rel in (".venv/bin/python", ".git/HEAD", "tidal/__pycache__/x.pyc", ".mypy_cache/x"):
        assert is_ignored(rel, rules), rel
    assert not any(f.startswith((".venv/", ".git/", "tests/")) for f in context_files())
