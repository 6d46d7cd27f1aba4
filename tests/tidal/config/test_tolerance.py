"""HyGen §5.2's SLO: a tolerance on one aggregate online metric over pure online serving."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tidal.config.cluster import parse_config
from tidal.config.tolerance import Tolerance


def summary(tbt_mean: float, tbt_p99: float, ttft_mean: float, ttft_p99: float) -> dict[str, Any]:
    return {
        "online": {
            "tbt_s": {"mean": tbt_mean, "p99": tbt_p99},
            "ttft_s": {"mean": ttft_mean, "p99": ttft_p99},
        }
    }


PURE = summary(0.020, 0.040, 0.30, 1.00)


def test_tolerance_bounds_the_metric_relative_to_pure_online() -> None:
    tol = Tolerance.parse("tbt_p99=0.05")
    assert (tol.metric, tol.ratio, tol.label) == ("tbt_p99", 0.05, "tbt_p99=0.05")
    assert tol.bound(PURE) == pytest.approx(0.042)  # 1.05 x 40 ms
    assert tol.meets(summary(0.5, 0.0419, 9.0, 9.0), PURE)  # only P99 TBT is judged
    assert not tol.meets(summary(0.02, 0.0421, 0.3, 1.0), PURE)
    assert tol.interference(summary(0.02, 0.050, 0.3, 1.0), PURE) == pytest.approx(0.25)
    ttft = Tolerance("ttft_mean", 0.1)
    assert ttft.meets(summary(1, 1, 0.33, 5), PURE) and not ttft.meets(summary(0, 0, 0.34, 0), PURE)


def test_a_zero_tolerance_is_the_pure_online_value_itself() -> None:
    tol = Tolerance("ttft_p99", 0.0)
    assert tol.meets(PURE, PURE) and not tol.meets(summary(0.02, 0.04, 0.3, 1.001), PURE)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tbt_p99", "expected METRIC=RATIO"),
        ("tbt_p99=five", "is not a number"),
        ("tpot_p99=0.05", "must be one of"),
        ("tbt_mean=-0.1", r"must be in \[0, 10\]"),
    ],
)
def test_bad_tolerances_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tolerance.parse(text)


def test_a_run_without_the_metric_fails_and_a_reference_without_it_is_an_error() -> None:
    # A budget below one decode step starts no online prompt: no TTFT sample at all.
    starved = summary(0.02, 0.04, float("nan"), float("nan"))
    tol = Tolerance("ttft_p99", 0.1)
    assert not tol.meets(starved, PURE) and tol.interference(starved, PURE) == float("inf")
    with pytest.raises(ValueError, match="pure online serving has no ttft_p99 sample"):
        tol.meets(PURE, starved)


BASE = """
name: t
model: llama-2-7b
hardware: a100-40gb
instances: [{role: aggregated}]
slo: {ttft_s: 1.0, tpot_s: 0.05}
online: {source: azure2023_conv.norm.csv}
"""


def test_configs_carry_tolerances_and_name_a_bad_one() -> None:
    data = yaml.safe_load(BASE + "slo_tolerances: [{metric: tbt_p99, ratio: 0.05}]\n")
    assert parse_config(data).slo_tolerances == (Tolerance("tbt_p99", 0.05),)
    assert parse_config(yaml.safe_load(BASE)).slo_tolerances == ()
    bad = yaml.safe_load(BASE + "slo_tolerances: [{metric: tbt_p99, ratio: 0.05, x: 1}]\n")
    with pytest.raises(ValueError, match=r"slo_tolerances\[0\]: unknown key"):
        parse_config(bad)
    with pytest.raises(ValueError, match="expected a list"):
        parse_config(yaml.safe_load(BASE + "slo_tolerances: {metric: tbt_p99}\n"))
