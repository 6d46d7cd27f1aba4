"""The preempt signal's body (`CtlPreempt`) as the instance parses it: `below_priority` is an
optional integer; anything else is refused with a message naming it, before any engine work."""

from __future__ import annotations

import pytest

from services.instance.preempt import MAX_PRIORITY, parse


def test_below_priority_is_optional_and_any_class_priority() -> None:
    assert parse(b'{"num_blocks": 4}').below_priority is None  # offline work only, as before
    assert parse(b'{"num_blocks": 4, "below_priority": 2}').below_priority == 2
    assert parse(b'{"num_blocks": 4, "below_priority": null}').below_priority is None
    assert parse(b'{"req_ids": ["a"], "below_priority": -3}').below_priority == -3


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"num_blocks": 1, "below_priority": "high"}', "got `str` - at `$.below_priority`"),
        (b'{"num_blocks": 1, "below_priority": 1.5}', "got `float` - at `$.below_priority`"),
        (b'{"num_blocks": 1, "below_priority": true}', "got `bool` - at `$.below_priority`"),
        (b'{"num_blocks": 1, "below_priority": 4294967296}', "below_priority must be an integer"),
        (b'{"num_blocks": 1, "below": 2}', "unknown field `below`"),
    ],
)
def test_a_bad_below_priority_is_refused_clearly(body: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=r"bad preempt request|below_priority must") as err:
        parse(body)
    assert why in str(err.value)


def test_the_bound_is_a_class_priority_s_range() -> None:
    assert parse(b'{"num_blocks": 1, "below_priority": %d}' % MAX_PRIORITY).below_priority
