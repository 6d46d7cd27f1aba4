"""Shipped configs are found by name from any directory; a path that exists wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.config.cluster import load_config
from tidal.configs import config_path, shipped


def test_shipped_names_resolve_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert {"embedded.yaml", "ooco.yaml", "hygen.yaml", "taichi.yaml"} <= set(shipped())
    for spelled in ("configs/ooco.yaml", "ooco.yaml", "ooco"):
        p = config_path(spelled)
        assert p.is_file() and p.name == "ooco.yaml"
        assert p.parent.name == "configs" and p.parent.parent.name == "tidal"
    assert load_config("configs/ooco.yaml").policy == load_config("ooco").policy


def test_an_existing_path_wins_and_a_missing_one_names_the_shipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "configs" / "ooco.yaml"
    mine.parent.mkdir()
    mine.write_text("policy: hygen\n")
    assert config_path("configs/ooco.yaml") == Path("configs/ooco.yaml")
    with pytest.raises(ValueError, match=r"config nope\.yaml does not exist; shipped configs: "):
        config_path("nope.yaml")
    with pytest.raises(ValueError, match="does not exist"):
        config_path(tmp_path / "elsewhere" / "ooco.yaml")  # only bare names fall back
