from __future__ import annotations

import pytest

from tidal.config.cluster import load_config
from tidal.sim.best_of import label, parse_best_of, pick_best, with_setting


def test_parse_makes_the_grid_of_a_policys_settings() -> None:
    got = parse_best_of(
        ["online-priority.max_decode_batch=32, 64", "online-priority.min_free_decode=0.1,0.2"],
        ["online-priority", "tidal"],
    )
    assert list(got) == ["online-priority"]
    assert [label(s) for s in got["online-priority"]] == [
        "max_decode_batch=32,min_free_decode=0.1",
        "max_decode_batch=32,min_free_decode=0.2",
        "max_decode_batch=64,min_free_decode=0.1",
        "max_decode_batch=64,min_free_decode=0.2",
    ]
    assert got["online-priority"][0] == (("max_decode_batch", 32), ("min_free_decode", 0.1))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("online-priority=1,2", "expected POLICY.PARAM"),
        ("online-priority.max_decode_batch", "expected POLICY.PARAM"),
        ("ooco.x=1", "not in --policies"),
        ("online-priority.max_decode_batch=", "no values"),
    ],
)
def test_bad_specs_are_clear_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_best_of([spec], ["online-priority"])


def test_a_param_given_twice_is_refused() -> None:
    specs = ["online-priority.max_decode_batch=1", "online-priority.max_decode_batch=2"]
    with pytest.raises(ValueError, match="given twice"):
        parse_best_of(specs, ["online-priority"])


def test_with_setting_overrides_only_that_policy() -> None:
    cfg = load_config("configs/ooco.yaml")
    c = with_setting(cfg, "online-priority", (("max_decode_batch", 128),))
    assert c.policy_params("online-priority")["max_decode_batch"] == 128
    assert c.policies["base-pd"] == cfg.policies["base-pd"]
    assert cfg.policy_params("online-priority")["max_decode_batch"] == 64  # cfg untouched


def test_pick_best_takes_the_most_tokens_first_on_a_tie() -> None:
    assert pick_best({"a": 1.0, "b": 3.0, "c": 3.0}) == "b"
    with pytest.raises(ValueError):
        pick_best({})
