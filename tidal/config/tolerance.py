"""HyGen's SLO: an interference tolerance on one aggregate online latency metric.

HyGen §5.2 sets its SLOs not per request but on one of four aggregate metrics of the online
requests — mean TBT, P99 TBT, mean TTFT, P99 TTFT — as a tolerance ratio over the same metric
under pure online serving (Sarathi, §5.1): with tolerance 5 % on P99 TBT, a co-located run
meets the SLO when its P99 TBT <= 1.05 x pure online's. `Tolerance` is one such SLO; it reads
the metric off a run's summary (`tidal.sim.metrics.summarize`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# metric name -> (summary["online"] key, statistic); TBT: the step times of steps carrying
# online decodes (HyGen's "time between tokens"), TTFT: arrival to first token.
METRICS: dict[str, tuple[str, str]] = {
    "tbt_mean": ("tbt_s", "mean"),
    "tbt_p99": ("tbt_s", "p99"),
    "ttft_mean": ("ttft_s", "mean"),
    "ttft_p99": ("ttft_s", "p99"),
}


@dataclass(frozen=True)
class Tolerance:
    """The SLO "`metric` at most (1 + `ratio`) x its value under pure online serving"."""

    metric: str  # one of METRICS
    ratio: float  # e.g. 0.05 for HyGen's 5 % tolerance (§5.4, Fig. 10)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(
                f"tolerance metric must be one of {sorted(METRICS)}, got {self.metric!r}"
            )
        if not 0 <= self.ratio <= 10 or math.isnan(self.ratio):
            raise ValueError(f"tolerance ratio must be in [0, 10], got {self.ratio}")

    @classmethod
    def parse(cls, text: str) -> Tolerance:
        """`tbt_p99=0.05` -> Tolerance("tbt_p99", 0.05)."""
        metric, eq, ratio = text.partition("=")
        if not eq:
            raise ValueError(f"tolerance {text!r}: expected METRIC=RATIO, e.g. tbt_p99=0.05")
        try:
            value = float(ratio)
        except ValueError as e:
            raise ValueError(f"tolerance {text!r}: ratio {ratio!r} is not a number") from e
        return cls(metric.strip(), value)

    @property
    def label(self) -> str:
        return f"{self.metric}={self.ratio:g}"

    def value(self, summary: Mapping[str, Any]) -> float:
        """The metric of one run, seconds; NaN when the run has no sample of it (no online
        request got a first token, or no step carried an online decode)."""
        key, stat = METRICS[self.metric]
        return float(summary["online"][key][stat])

    def reference(self, pure_online: Mapping[str, Any]) -> float:
        """The metric under pure online serving. A reference with no sample of it is an
        error: there is nothing to be tolerant of."""
        ref = self.value(pure_online)
        if math.isnan(ref):
            raise ValueError(f"pure online serving has no {self.metric} sample (no online load?)")
        return ref

    def bound(self, pure_online: Mapping[str, Any]) -> float:
        """The SLO in seconds: (1 + ratio) x the metric under pure online serving."""
        return (1.0 + self.ratio) * self.reference(pure_online)

    def meets(self, summary: Mapping[str, Any], pure_online: Mapping[str, Any]) -> bool:
        """Whether a co-located run stays within the tolerance; a run with no sample of the
        metric (its online requests never started) does not."""
        v = self.value(summary)
        return not math.isnan(v) and v <= self.bound(pure_online)

    def interference(self, summary: Mapping[str, Any], pure_online: Mapping[str, Any]) -> float:
        """The run's metric over pure online's, minus one (0.05 = 5 % interference; inf when
        the run has no sample)."""
        v = self.value(summary)
        return math.inf if math.isnan(v) else v / self.reference(pure_online) - 1.0
