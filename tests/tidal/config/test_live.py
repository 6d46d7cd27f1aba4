"""The live config refuses a policy on instance roles it cannot serve online requests on."""

from __future__ import annotations

import pytest

from tidal.config.live import load_live_config


def test_tidal_on_aggregated_instances_is_refused() -> None:
    with pytest.raises(ValueError, match="policy tidal runs on relaxed and strict instances"):
        load_live_config("", "tidal", "aggregated,aggregated")


def test_roles_each_policy_serves_are_accepted() -> None:
    assert len(load_live_config("", "tidal", "relaxed,strict,strict").slots) == 3
    assert len(load_live_config("", "ooco", "relaxed").slots) == 1
    assert len(load_live_config("", "aggregated", "aggregated,aggregated").slots) == 2
    assert len(load_live_config("", "tidal").slots) == 2  # the shipped config: relaxed + strict
