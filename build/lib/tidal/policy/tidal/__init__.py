"""Tidal's combination policy (`tidal`): see `tidal.policy.tidal.policy`."""

from __future__ import annotations

from tidal.policy.tidal.config import TidalConfig
from tidal.policy.tidal.policy import TidalPolicy

__all__ = ["TidalConfig", "TidalPolicy"]
