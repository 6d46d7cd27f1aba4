"""Request classes from the cluster config: parsing, the key rules, the demotion chain."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tidal.config.classes import ClassError, ClassTable, RequestClassSpec, parse_classes
from tidal.config.cluster import load_config
from tidal.configs import config_path
from tidal.schemas.enums import RequestClass

THREE = [
    {"name": "interactive", "priority": 2, "ttft_ms": 1000, "tpot_ms": 100, "queue_bound": 8},
    {"name": "standard", "priority": 1, "ttft_ms": 4000, "queue_bound": 4, "demote": True},
    {"name": "batch", "priority": 0, "best_effort": True},
]


def test_three_classes_order_kinds_and_chain() -> None:
    t = parse_classes(list(reversed(THREE)), "standard", {"sk-a": {"cap": "standard"}})
    assert t.names == ["interactive", "standard", "batch"]  # highest priority first
    assert [c.kind for c in t.classes] == [RequestClass.ONLINE] * 2 + [RequestClass.OFFLINE]
    assert t.lowest.name == "batch" and t.default_name == "standard"
    std, inter = t.get("standard"), t.get("interactive")
    assert [c.name for c in t.chain(std)] == ["standard", "batch"]
    assert [c.name for c in t.chain(inter)] == ["interactive"]  # demote: false
    assert t.has_room(std, 3) and not t.has_room(std, 4)
    assert t.has_room(t.get("batch"), 10**6)  # no bound
    assert all(c.slo_admission for c in t.classes)  # the default: the policy may refuse
    patient = RequestClassSpec("patient", 5, ttft_ms=10, admission="queue")
    assert not patient.slo_admission


def test_chain_goes_on_while_each_class_demotes() -> None:
    t = ClassTable(
        (
            RequestClassSpec("a", 3, ttft_ms=100, demote=True),
            RequestClassSpec("b", 2, ttft_ms=500, demote=False),
            RequestClassSpec("c", 0, best_effort=True),
        )
    )
    assert [c.name for c in t.chain(t.get("a"))] == ["a", "b"]  # b does not pass it on


def test_resolve_default_pin_and_cap() -> None:
    keys = {"sk-a": {"cap": "standard"}, "sk-etl": {"pin": "batch"}}
    t = parse_classes(THREE, None, keys)
    assert t.resolve(None).name == "interactive"  # the default: the highest class
    assert t.resolve("batch").name == "batch"
    assert t.resolve(None, "sk-a").name == "standard"  # above its cap: its cap
    assert t.resolve("batch", "sk-a").name == "batch"
    assert t.resolve(None, "sk-etl").name == "batch"
    with pytest.raises(ClassError, match="or looser"):
        t.resolve("interactive", "sk-a")
    with pytest.raises(ClassError, match="pinned to class 'batch'"):
        t.resolve("standard", "sk-etl")
    with pytest.raises(ClassError, match="classes: interactive, standard, batch"):
        t.resolve("gold")


def test_default_pair_without_a_section() -> None:
    t = parse_classes(None)
    assert t.names == ["online", "offline"] and t.default_name == "online"
    assert t.get("online").ttft_ms is None  # the config's SLO (the scheduler's default)
    assert load_config("embedded.yaml").classes.names == ["online", "offline"]


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (
            [
                {"name": "a", "priority": 1, "best_effort": True},
                {"name": "a", "priority": 0, "best_effort": True},
            ],
            "names must be unique",
        ),
        (
            [
                {"name": "a", "priority": 1, "ttft_ms": 5},
                {"name": "b", "priority": 1, "best_effort": True},
            ],
            "priorities must be unique",
        ),
        ([{"name": "a", "priority": 1, "ttft_ms": 5}], "must be best_effort"),
        ([{"name": "A b", "priority": 0, "best_effort": True}], "lower-case"),
        ([{"name": "a", "priority": 0, "best_effort": True, "ttft_ms": 5}], "no ttft_ms"),
        ([{"name": "a", "priority": 0, "best_effort": True, "queue_bound": 0}], "queue_bound"),
        ([{"name": "a", "priority": 0, "best_effort": True, "colour": 1}], "unknown key"),
        ([{"name": "a", "priority": "hi", "best_effort": True}], "priority"),
        ([{"name": "a", "priority": 0, "ttft_ms": -1}], "ttft_ms"),
        ("online", "a list of classes"),
        ([{"name": "a", "priority": 0, "ttft_ms": 5, "admission": "maybe"}], "admission"),
        ([{"name": "a", "priority": 0, "best_effort": True, "admission": "queue"}], "no SLO adm"),
    ],
)
def test_bad_sections_say_what_is_wrong(raw: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_classes(raw, where="c.yaml")


def test_bad_default_and_key_rules() -> None:
    with pytest.raises(ValueError, match="default_class 'gold'"):
        parse_classes(THREE, "gold")
    with pytest.raises(ValueError, match="'gold' is not a class"):
        parse_classes(THREE, None, {"k": {"pin": "gold"}})
    with pytest.raises(ValueError, match="pin: CLASS"):
        parse_classes(THREE, None, {"k": {"pin": "batch", "cap": "batch"}})
    with pytest.raises(ValueError, match="pin: CLASS") as err:
        parse_classes(THREE, None, {"sk-secret": {}})
    assert "sk-secret" not in str(err.value)  # a key is never echoed


def test_config_file_with_classes(tmp_path: Path) -> None:
    data = yaml.safe_load(config_path("embedded.yaml").read_text())
    data |= {"classes": THREE, "default_class": "standard"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert cfg.classes.names == ["interactive", "standard", "batch"]
    assert cfg.classes.default_name == "standard"
    data["classes"][2]["best_effort"] = False
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"c\.yaml: classes: the lowest class \(batch\)"):
        load_config(path)
