"""The README a newcomer reads: short, free of our own process words, and every relative link
in it and in docs/ names a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PROCESS_WORDS = re.compile(r"\bissue \d+|another engineer|papers/\w+\.md", re.IGNORECASE)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short_and_has_the_quickstart() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 150
    assert "make up" in text and "make test" in text
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_no_process_words_in_the_readme_or_docs_pages() -> None:
    for page in _pages():
        found = PROCESS_WORDS.findall(page.read_text())
        assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_relative_links_name_files_that_exist() -> None:
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} -> {target}"
