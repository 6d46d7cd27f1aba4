"""The engine tests' tiny random-weight checkpoints (`tests/tidal/engine/conftest.py`), here too."""

from __future__ import annotations

from tests.tidal.engine.conftest import _one_torch_thread, tiny_dirs

__all__ = ["_one_torch_thread", "tiny_dirs"]
