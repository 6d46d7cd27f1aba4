"""The model cache's keys and pruning (`tidal.engine.tokenizer`): one conversion per model file,
whatever checkout or virtualenv holds it, and none kept forever."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tidal.engine.tokenizer import CACHE_KEEP_S, cache_hit, file_key, prune_cache


def test_the_cache_key_follows_the_content_not_the_path(tmp_path: Path) -> None:
    # keyed by path, each fresh clone's virtualenv converted the embedded model again (1.4 GB)
    data = bytes(range(256)) * 12_000  # ~3 MiB: the ends and the sampled spans all differ
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(data)
    os.utime(b, (1, 1))
    assert file_key(a) == file_key(b)
    b.write_bytes(data[:-1] + b"\x00")  # one byte of the last MiB (was 0xff)
    assert file_key(a) != file_key(b)
    b.write_bytes(data + b"\x00")
    assert file_key(a) != file_key(b)


def test_prune_removes_only_this_files_conversions_unused_for_a_week(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    old = time.time() - CACHE_KEEP_S - 60
    names = {
        "m-0123456789abcdef": True,  # stale: goes
        "m-0123456789abcdef-tokenizer": True,
        "m-fedcba9876543210": False,  # used recently: stays
        "m.Q4-0123456789abcdef": False,  # another file's: stays
        "m-notakey": False,  # not a conversion: stays
        "native": False,
    }
    for name, stale in names.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text("x")
        if stale or name in ("m.Q4-0123456789abcdef", "m-notakey", "native"):
            os.utime(tmp_path / name, (old, old))
    cache_hit(tmp_path / "m-fedcba9876543210")
    gone = prune_cache("m")
    assert sorted(p.name for p in gone) == ["m-0123456789abcdef", "m-0123456789abcdef-tokenizer"]
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {n for n, stale in names.items() if not stale}
